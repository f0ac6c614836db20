//! The simulated engine's options, shared by every subcommand that runs kvroute-mocker's live
//! engine (`kvroute worker --mock`, `kvroute engine-sim`): one clap struct, so the flags and
//! their checks are written once.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use kvroute_mocker::MockerConfig;

use crate::replay::EngineProfile;

/// Sizing and timing of the simulated engine.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct MockerArgs {
    /// Engine sizing and step timing: `h100-8b` (an 8B BF16 model on one H100: 25,000 blocks of
    /// 16 tokens, roofline step times; the default) or `reference` (Dynamo 1.6.1's mocker:
    /// 16,384 blocks of 64 tokens, its polynomial step times). --block-size and --cache-blocks
    /// override the sizing.
    #[arg(long, value_enum, value_name = "P", conflicts_with = "mocker_config")]
    profile: Option<EngineProfile>,
    /// A mocker config file (TOML, or JSON for a .json path): block size, capacity, timing.
    #[arg(long, value_name = "FILE")]
    mocker_config: Option<PathBuf>,
    /// Run the simulated engine this many times faster than the modelled GPU.
    #[arg(long, value_name = "X")]
    speedup: Option<f64>,
    /// Tokens per KV block of the simulated engine [default: the profile's].
    #[arg(long, value_name = "TOKENS")]
    block_size: Option<u32>,
    /// KV cache capacity of the simulated engine, in blocks [default: the profile's].
    #[arg(long, value_name = "BLOCKS")]
    cache_blocks: Option<u32>,
}

impl MockerArgs {
    /// Whether any option was given (they configure only a simulated engine).
    pub(crate) fn any_given(&self) -> bool {
        self.profile.is_some()
            || self.mocker_config.is_some()
            || self.speedup.is_some()
            || self.block_size.is_some()
            || self.cache_blocks.is_some()
    }

    /// The engine configuration: the config file or the profile, then the overrides, checked.
    pub(crate) fn config(&self) -> anyhow::Result<MockerConfig> {
        let mut config = match (&self.mocker_config, self.profile) {
            (Some(path), _) => MockerConfig::from_file(path)
                .with_context(|| format!("reading mocker config {}", path.display()))?,
            (None, Some(profile)) => profile.mocker(),
            (None, None) => MockerConfig::default(),
        };
        if let Some(speedup) = self.speedup {
            config.speedup = speedup;
        }
        if let Some(block_size) = self.block_size {
            if block_size == 0 {
                bail!("--block-size must be at least 1 token, got 0");
            }
            config.block_size = block_size;
        }
        if let Some(blocks) = self.cache_blocks {
            if blocks == 0 {
                bail!("--cache-blocks must be at least 1, got 0");
            }
            config.num_blocks = blocks;
        }
        config.validate().context(
            "invalid simulated engine configuration (--profile / --mocker-config / --speedup / \
             --block-size / --cache-blocks)",
        )?;
        Ok(config)
    }
}
