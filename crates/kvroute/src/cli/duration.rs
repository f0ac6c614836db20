//! [`HumanDuration`]: the `250ms`, `5s`, `2m`, `1h` syntax of every duration flag and key.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

/// A duration written as a number with a unit: `250ms`, `5s`, `2m`, `1h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HumanDuration(pub(crate) Duration);

impl FromStr for HumanDuration {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        let expected = || format!("expected a duration like 250ms, 5s, 2m or 1h, got {s:?}");
        let n: u64 = number.parse().map_err(|_| expected())?;
        let duration = match unit {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            _ => return Err(expected()),
        };
        Ok(HumanDuration(duration))
    }
}

/// Whole seconds as `Ns`, anything finer as `Nms` (sub-millisecond parts are dropped): what
/// `--help` shows as a default, and parses back to the same duration.
impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let millis = self.0.as_millis();
        if millis.is_multiple_of(1000) {
            write!(f, "{}s", millis / 1000)
        } else {
            write!(f, "{millis}ms")
        }
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests;
