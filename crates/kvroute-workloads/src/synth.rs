//! Seeded synthetic workloads in the Mooncake trace shape ([`crate::trace::TraceRecord`]), so that
//! no benchmark figure depends on one recorded trace.
//!
//! The evaluation set ([`Workload::NAMES`]):
//! - [`AgenticConfig`] (`agentic`, `agentic-tools`): agent sessions whose context grows turn by
//!   turn from about 20k to 200k tokens (tool results and model output appended), compacts to a
//!   fresh summary when it reaches its limit, and forks sub-agents that start from the parent's
//!   whole context plus a task of their own. Many sessions run at once, so a fleet's caches are
//!   under eviction pressure. `agentic-tools` adds tool-call turns (a short tool result in, a
//!   short call out, a short gap) and idle gaps (the user away for minutes).
//! - [`MultiTurnConfig`] (`multi-turn`): chat sessions over a handful of shared system prompts,
//!   each turn resending the whole conversation.
//! - [`RagConfig`] (`rag`): questions over a pool of long shared documents (a few popular ones
//!   asked about most), each user asking a few follow-ups about one document.
//! - [`BurstyConfig`] (`bursty`): the others mixed (small), their arrivals squeezed into bursts
//!   separated by quiet periods.
//!
//! Every hash id stands for one [`MOONCAKE_BLOCK_TOKENS`]-token block of a prompt and, with the
//! ids before it, for the whole prefix: a full block keeps its id for the rest of a session (and in
//! the sub-agents forked from it); a partial trailing block gets a fresh id each time it is sent.
//! The same config and seed always give the same records. Records come in timestamp order.

use crate::trace::{MOONCAKE_BLOCK_TOKENS, TraceRecord};

/// One generated request and the session it belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthRequest {
    /// The request as a trace line.
    pub record: TraceRecord,
    /// Session (agent, sub-agent or chat) that sent it; unique within one generated workload.
    pub session_id: u64,
    /// The session a sub-agent was forked from.
    pub parent_session: Option<u64>,
}

/// A named workload with its default shape, as chosen on a command line.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Workload {
    /// Long-context agent sessions with sub-agents ([`AgenticConfig`]).
    Agentic(AgenticConfig),
    /// Multi-turn chat over shared system prompts ([`MultiTurnConfig`]).
    MultiTurn(MultiTurnConfig),
    /// Questions over a pool of shared documents ([`RagConfig`]).
    Rag(RagConfig),
    /// The others mixed and arriving in bursts ([`BurstyConfig`]).
    Bursty(BurstyConfig),
}

/// A workload name that is not one of [`Workload::NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown workload `{0}`: expected one of agentic, agentic-tools, multi-turn, rag, bursty")]
pub struct UnknownWorkload(pub String);

impl Workload {
    /// The names [`Workload::from_name`] accepts.
    pub const NAMES: &'static [&'static str] =
        &["agentic", "agentic-tools", "multi-turn", "rag", "bursty"];

    /// The workload called `name` with its default config.
    pub fn from_name(name: &str) -> Result<Self, UnknownWorkload> {
        match name {
            "agentic" => Ok(Self::Agentic(AgenticConfig::default())),
            "agentic-tools" => Ok(Self::Agentic(AgenticConfig::with_tools())),
            "multi-turn" => Ok(Self::MultiTurn(MultiTurnConfig::default())),
            "rag" => Ok(Self::Rag(RagConfig::default())),
            "bursty" => Ok(Self::Bursty(BurstyConfig::default())),
            other => Err(UnknownWorkload(other.to_owned())),
        }
    }

    /// The same workload scaled to about `factor` times its sessions (at least one of each
    /// kind), keeping every other parameter: `0.1` makes a CI-sized version of the set.
    pub fn scaled(&self, factor: f64) -> Self {
        let n = |sessions: u32| ((f64::from(sessions) * factor).round() as u32).max(1);
        match self {
            Self::Agentic(c) => Self::Agentic(AgenticConfig {
                sessions: n(c.sessions),
                concurrency: n(c.concurrency).min(n(c.sessions)),
                ..c.clone()
            }),
            Self::MultiTurn(c) => Self::MultiTurn(MultiTurnConfig {
                sessions: n(c.sessions),
                ..c.clone()
            }),
            Self::Rag(c) => Self::Rag(RagConfig {
                sessions: n(c.sessions),
                ..c.clone()
            }),
            Self::Bursty(c) => Self::Bursty(BurstyConfig {
                agentic: AgenticConfig {
                    sessions: n(c.agentic.sessions),
                    concurrency: n(c.agentic.concurrency).min(n(c.agentic.sessions)),
                    ..c.agentic.clone()
                },
                multi_turn: MultiTurnConfig {
                    sessions: n(c.multi_turn.sessions),
                    ..c.multi_turn.clone()
                },
                rag: RagConfig {
                    sessions: n(c.rag.sessions),
                    ..c.rag.clone()
                },
                ..c.clone()
            }),
        }
    }

    /// The requests of this workload for `seed`, in timestamp order.
    pub fn generate(&self, seed: u64) -> Vec<SynthRequest> {
        match self {
            Self::Agentic(config) => agentic(config, seed),
            Self::MultiTurn(config) => multi_turn(config, seed),
            Self::Rag(config) => rag(config, seed),
            Self::Bursty(config) => bursty(config, seed),
        }
    }
}

/// Shape of [`agentic`] workloads. Token ranges are inclusive `(min, max)`, drawn uniformly.
#[derive(Debug, Clone, PartialEq)]
pub struct AgenticConfig {
    /// Top-level agent sessions in the whole workload.
    pub sessions: u32,
    /// Sessions running at the same time; a new one starts when one ends.
    pub concurrency: u32,
    /// Tokens of the system prompt and tool definitions every agent shares.
    pub shared_prefix_tokens: u32,
    /// Tokens of a session's own task and first files, after the shared prefix.
    pub task_tokens: (u32, u32),
    /// Tokens a turn appends (tool output plus the next instruction).
    pub turn_tokens: (u32, u32),
    /// Tokens the model generates per turn (appended to the context too).
    pub output_tokens: (u32, u32),
    /// A session's context limit: a turn that would pass it compacts the context first.
    pub max_context_tokens: u32,
    /// Tokens of the summary a compaction leaves after the shared prefix.
    pub summary_tokens: (u32, u32),
    /// Compactions after which a session ends.
    pub compactions: u32,
    /// Chance that a turn also forks a sub-agent from the context so far.
    pub fork_probability: f64,
    /// Turns of one sub-agent.
    pub subagent_turns: (u32, u32),
    /// Milliseconds between a session's turns (tool calls and generation).
    pub turn_gap_ms: (u32, u32),
    /// Chance that a turn is a tool-call round trip instead: it appends a short tool result
    /// ([`Self::tool_result_tokens`]), the model answers with a short call
    /// ([`Self::tool_output_tokens`]) and the next turn follows after [`Self::tool_gap_ms`].
    /// Sub-agents make tool calls too. 0 draws nothing (the `agentic` default).
    pub tool_call_probability: f64,
    /// Tokens a tool-call turn appends (the tool's result).
    pub tool_result_tokens: (u32, u32),
    /// Tokens the model generates on a tool-call turn.
    pub tool_output_tokens: (u32, u32),
    /// Milliseconds before the turn after a tool call (the tool runs fast).
    pub tool_gap_ms: (u32, u32),
    /// Chance that a top-level session goes idle after a turn (the user away): the next turn
    /// comes after [`Self::idle_gap_ms`]. 0 draws nothing (the `agentic` default).
    pub idle_probability: f64,
    /// Milliseconds of an idle gap.
    pub idle_gap_ms: (u32, u32),
}

impl Default for AgenticConfig {
    fn default() -> Self {
        Self {
            sessions: 12,
            concurrency: 6,
            shared_prefix_tokens: 8_000,
            task_tokens: (8_000, 16_000),
            turn_tokens: (1_000, 12_000),
            output_tokens: (100, 1_500),
            max_context_tokens: 200_000,
            summary_tokens: (4_000, 12_000),
            compactions: 1,
            fork_probability: 0.12,
            subagent_turns: (1, 4),
            turn_gap_ms: (2_000, 20_000),
            tool_call_probability: 0.0,
            tool_result_tokens: (50, 1_500),
            tool_output_tokens: (20, 200),
            tool_gap_ms: (300, 3_000),
            idle_probability: 0.0,
            idle_gap_ms: (120_000, 900_000),
        }
    }
}

impl AgenticConfig {
    /// The `agentic-tools` workload: most turns are tool calls with short outputs, sub-agents
    /// fork more often, and sessions go idle for minutes now and then.
    pub fn with_tools() -> Self {
        Self {
            sessions: 16,
            concurrency: 8,
            shared_prefix_tokens: 10_000,
            task_tokens: (10_000, 20_000),
            turn_tokens: (2_000, 12_000),
            compactions: 0,
            fork_probability: 0.15,
            subagent_turns: (2, 6),
            tool_call_probability: 0.7,
            idle_probability: 0.05,
            ..Self::default()
        }
    }
}

/// Shape of [`multi_turn`] workloads. Token ranges are inclusive `(min, max)`, drawn uniformly.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiTurnConfig {
    /// Chat sessions in the whole workload.
    pub sessions: u32,
    /// Distinct system prompts; session `k` mostly picks the first ones (weight `1 / (i + 1)`).
    pub system_prompts: u32,
    /// Tokens of each system prompt.
    pub system_tokens: (u32, u32),
    /// Turns per session.
    pub turns: (u32, u32),
    /// Tokens of one user message.
    pub user_tokens: (u32, u32),
    /// Tokens of one answer.
    pub output_tokens: (u32, u32),
    /// Mean milliseconds between session starts (exponential gaps).
    pub session_gap_ms: f64,
    /// Milliseconds between a session's turns.
    pub turn_gap_ms: (u32, u32),
}

impl Default for MultiTurnConfig {
    fn default() -> Self {
        Self {
            sessions: 600,
            system_prompts: 8,
            system_tokens: (2_000, 8_000),
            turns: (2, 12),
            user_tokens: (200, 2_500),
            output_tokens: (100, 1_000),
            session_gap_ms: 500.0,
            turn_gap_ms: (5_000, 60_000),
        }
    }
}

/// Agent sessions with growing long contexts, compaction and sub-agents (see the module docs).
pub fn agentic(config: &AgenticConfig, seed: u64) -> Vec<SynthRequest> {
    let mut rng = SplitMix64::new(seed);
    let mut ids = IdSource::default();
    let shared = Context::fresh(&mut ids, config.shared_prefix_tokens);
    let mut out = Vec::new();
    let mut next_session = 0u64;
    // Each running session (or sub-agent): when its next turn is due.
    let mut running: Vec<Agent> = Vec::new();
    let mut started = 0u32;
    let mut now = 0.0f64;
    let concurrency = config.concurrency.max(1);
    loop {
        while started < config.sessions && count_top(&running) < concurrency as usize {
            let mut context = shared.clone();
            context.append(&mut ids, rng.range(config.task_tokens));
            running.push(Agent {
                session: next_session,
                parent: None,
                context,
                due: now + rng.range(config.turn_gap_ms) as f64,
                turns_left: None,
                compactions_left: config.compactions,
            });
            next_session += 1;
            started += 1;
        }
        let Some(i) = (0..running.len()).min_by(|&a, &b| running[a].due.total_cmp(&running[b].due))
        else {
            break;
        };
        now = running[i].due;
        let tool_call =
            config.tool_call_probability > 0.0 && rng.chance(config.tool_call_probability);
        let turn = if tool_call {
            rng.range(config.tool_result_tokens)
        } else {
            rng.range(config.turn_tokens)
        };
        let agent = &mut running[i];
        if agent.context.tokens.saturating_add(turn) > config.max_context_tokens {
            if agent.turns_left.is_some() || agent.compactions_left == 0 {
                running.swap_remove(i);
                continue;
            }
            agent.compactions_left -= 1;
            agent.context = shared.clone();
            agent
                .context
                .append(&mut ids, rng.range(config.summary_tokens));
        }
        agent.context.append(&mut ids, turn);
        let output = if tool_call {
            rng.range(config.tool_output_tokens)
        } else {
            rng.range(config.output_tokens)
        };
        out.push(SynthRequest {
            record: agent.context.record(&mut ids, now, output),
            session_id: agent.session,
            parent_session: agent.parent,
        });
        agent.context.append(&mut ids, output);
        let idle = agent.parent.is_none()
            && config.idle_probability > 0.0
            && rng.chance(config.idle_probability);
        let gap = if idle {
            config.idle_gap_ms
        } else if tool_call {
            config.tool_gap_ms
        } else {
            config.turn_gap_ms
        };
        agent.due = now + rng.range(gap) as f64;
        let mut finished = false;
        if let Some(left) = &mut agent.turns_left {
            *left -= 1;
            finished = *left == 0;
        }
        let fork = agent.turns_left.is_none() && rng.chance(config.fork_probability);
        if fork {
            let mut context = agent.context.clone();
            let parent = agent.session;
            context.append(&mut ids, rng.range(config.task_tokens) / 4);
            running.push(Agent {
                session: next_session,
                parent: Some(parent),
                context,
                due: now + rng.range(config.turn_gap_ms) as f64 / 4.0,
                turns_left: Some(rng.range(config.subagent_turns).max(1)),
                compactions_left: 0,
            });
            next_session += 1;
        }
        if finished {
            running.swap_remove(i);
        }
    }
    out
}

/// Chat sessions over shared system prompts (see the module docs).
pub fn multi_turn(config: &MultiTurnConfig, seed: u64) -> Vec<SynthRequest> {
    let mut rng = SplitMix64::new(seed);
    let mut ids = IdSource::default();
    let prompts: Vec<Context> = (0..config.system_prompts.max(1))
        .map(|_| {
            let tokens = rng.range(config.system_tokens);
            Context::fresh(&mut ids, tokens)
        })
        .collect();
    let weights: Vec<f64> = (0..prompts.len()).map(|i| 1.0 / (i + 1) as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut out = Vec::new();
    let mut start = 0.0f64;
    for session in 0..u64::from(config.sessions) {
        start += rng.exponential(config.session_gap_ms);
        let mut pick = rng.unit() * total;
        let prompt = weights
            .iter()
            .position(|w| {
                pick -= w;
                pick < 0.0
            })
            .unwrap_or(prompts.len() - 1);
        let turns = Turns {
            count: config.turns,
            user_tokens: config.user_tokens,
            output_tokens: config.output_tokens,
            gap_ms: config.turn_gap_ms,
        };
        let context = prompts[prompt].clone();
        turns.push(&mut out, context, &mut ids, &mut rng, session, start);
    }
    out.sort_by(|a, b| a.record.timestamp.total_cmp(&b.record.timestamp));
    out
}

/// Shape of [`rag`] workloads. Token ranges are inclusive `(min, max)`, drawn uniformly.
#[derive(Debug, Clone, PartialEq)]
pub struct RagConfig {
    /// Users in the whole workload; each asks a few questions about one document.
    pub sessions: u32,
    /// Documents in the pool.
    pub documents: u32,
    /// Zipf exponent of document popularity: document `i` is picked with weight
    /// `1 / (i + 1)^s`, so a few documents draw most questions.
    pub popularity: f64,
    /// Tokens of one document.
    pub document_tokens: (u32, u32),
    /// Distinct system prompts (instructions for answering from the document).
    pub system_prompts: u32,
    /// Tokens of each system prompt.
    pub system_tokens: (u32, u32),
    /// Questions per user (the first and its follow-ups, each resending the conversation).
    pub questions: (u32, u32),
    /// Tokens of one question.
    pub question_tokens: (u32, u32),
    /// Tokens of one answer.
    pub output_tokens: (u32, u32),
    /// Mean milliseconds between users' first questions (exponential gaps).
    pub session_gap_ms: f64,
    /// Milliseconds between a user's questions.
    pub question_gap_ms: (u32, u32),
}

impl Default for RagConfig {
    fn default() -> Self {
        Self {
            sessions: 500,
            documents: 64,
            popularity: 1.0,
            document_tokens: (8_000, 40_000),
            system_prompts: 2,
            system_tokens: (500, 1_500),
            questions: (1, 4),
            question_tokens: (20, 300),
            output_tokens: (50, 500),
            session_gap_ms: 400.0,
            question_gap_ms: (5_000, 30_000),
        }
    }
}

/// Questions over a pool of long shared documents (see the module docs). A prompt is a system
/// prompt, then the document, then the conversation: users of the same system prompt and
/// document share everything up to their first question.
pub fn rag(config: &RagConfig, seed: u64) -> Vec<SynthRequest> {
    let mut rng = SplitMix64::new(seed);
    let mut ids = IdSource::default();
    let prompts: Vec<Context> = (0..config.system_prompts.max(1))
        .map(|_| {
            let tokens = rng.range(config.system_tokens);
            Context::fresh(&mut ids, tokens)
        })
        .collect();
    let documents: Vec<u32> = (0..config.documents.max(1))
        .map(|_| rng.range(config.document_tokens))
        .collect();
    let doc_weights: Vec<f64> = (0..documents.len())
        .map(|i| 1.0 / ((i + 1) as f64).powf(config.popularity))
        .collect();
    // A (system prompt, document) prefix is content: the same pair always has the same ids.
    let mut prefixes: std::collections::HashMap<(usize, usize), Context> =
        std::collections::HashMap::new();
    let mut out = Vec::new();
    let mut start = 0.0f64;
    for session in 0..u64::from(config.sessions) {
        start += rng.exponential(config.session_gap_ms);
        let prompt = (rng.next() % prompts.len() as u64) as usize;
        let document = rng.weighted(&doc_weights);
        let context = prefixes
            .entry((prompt, document))
            .or_insert_with(|| {
                let mut c = prompts[prompt].clone();
                c.append(&mut ids, documents[document]);
                c
            })
            .clone();
        let turns = Turns {
            count: config.questions,
            user_tokens: config.question_tokens,
            output_tokens: config.output_tokens,
            gap_ms: config.question_gap_ms,
        };
        turns.push(&mut out, context, &mut ids, &mut rng, session, start);
    }
    out.sort_by(|a, b| a.record.timestamp.total_cmp(&b.record.timestamp));
    out
}

/// Shape of [`bursty`] workloads: smaller versions of the others, mixed, their arrivals squeezed
/// into bursts.
#[derive(Debug, Clone, PartialEq)]
pub struct BurstyConfig {
    /// The agent sessions of the mix (tool calls and idle gaps included).
    pub agentic: AgenticConfig,
    /// The chat sessions of the mix.
    pub multi_turn: MultiTurnConfig,
    /// The document questions of the mix.
    pub rag: RagConfig,
    /// Milliseconds from the start of one burst to the start of the next.
    pub period_ms: f64,
    /// Milliseconds of each burst: everything that would arrive during a period arrives in its
    /// first `burst_ms`, in the same order (so `period_ms / burst_ms` times as fast).
    pub burst_ms: f64,
}

impl Default for BurstyConfig {
    fn default() -> Self {
        Self {
            agentic: AgenticConfig {
                sessions: 6,
                concurrency: 3,
                ..AgenticConfig::with_tools()
            },
            multi_turn: MultiTurnConfig {
                sessions: 300,
                ..MultiTurnConfig::default()
            },
            rag: RagConfig {
                sessions: 250,
                ..RagConfig::default()
            },
            period_ms: 60_000.0,
            burst_ms: 10_000.0,
        }
    }
}

/// The other workloads mixed, arriving in bursts (see [`BurstyConfig`]). Each part keeps its own
/// content: hash ids and session ids of one part never collide with another's. Session ids are
/// agent sessions first, then chats, then document users.
pub fn bursty(config: &BurstyConfig, seed: u64) -> Vec<SynthRequest> {
    let parts = [
        agentic(&config.agentic, seed),
        multi_turn(&config.multi_turn, seed.wrapping_add(1)),
        rag(&config.rag, seed.wrapping_add(2)),
    ];
    let mut out = Vec::new();
    let (mut id_base, mut session_base) = (0u64, 0u64);
    for part in parts {
        let max_id = part
            .iter()
            .flat_map(|r| r.record.hash_ids.iter().copied())
            .max()
            .unwrap_or(0);
        let max_session = part.iter().map(|r| r.session_id + 1).max().unwrap_or(0);
        for mut r in part {
            for id in &mut r.record.hash_ids {
                *id += id_base;
            }
            r.session_id += session_base;
            r.parent_session = r.parent_session.map(|p| p + session_base);
            out.push(r);
        }
        id_base += max_id;
        session_base += max_session;
    }
    let period = config.period_ms.max(1.0);
    let burst = config.burst_ms.clamp(1.0, period);
    for r in &mut out {
        let t = r.record.timestamp;
        let squeezed = (t / period).floor() * period + (t % period) * burst / period;
        r.record.timestamp = squeezed.round();
    }
    // Stable: requests squeezed onto the same millisecond keep their order within a part.
    out.sort_by(|a, b| a.record.timestamp.total_cmp(&b.record.timestamp));
    out
}

/// The requests as a Mooncake JSONL trace (what [`crate::trace::parse_jsonl`] reads), with the
/// session as an extra `session_id` field (and `parent_session_id` for sub-agents), written as
/// strings: the reference's Mooncake reader (Dynamo 1.6.1) refuses a numeric `session_id`.
pub fn to_jsonl(requests: &[SynthRequest]) -> String {
    let mut out = String::new();
    for r in requests {
        let mut line = serde_json::json!({
            "timestamp": r.record.timestamp,
            "input_length": r.record.input_length,
            "output_length": r.record.output_length,
            "hash_ids": r.record.hash_ids,
            "session_id": r.session_id.to_string(),
        });
        if let (Some(parent), Some(map)) = (r.parent_session, line.as_object_mut()) {
            map.insert("parent_session_id".to_owned(), parent.to_string().into());
        }
        out.push_str(&line.to_string());
        out.push('\n');
    }
    out
}

/// One running agent or sub-agent.
struct Agent {
    session: u64,
    parent: Option<u64>,
    context: Context,
    due: f64,
    /// Turns left for a sub-agent; `None` for a top-level session.
    turns_left: Option<u32>,
    compactions_left: u32,
}

fn count_top(running: &[Agent]) -> usize {
    running.iter().filter(|a| a.parent.is_none()).count()
}

/// Hands out hash ids, each standing for a block content never seen before.
#[derive(Default)]
struct IdSource {
    next: u64,
}

impl IdSource {
    fn fresh(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

/// The turns of one chat-like session (multi-turn chat, RAG questions): each adds the user's
/// tokens to the context, is asked with its output length drawn, then appends that output.
struct Turns {
    count: (u32, u32),
    user_tokens: (u32, u32),
    output_tokens: (u32, u32),
    gap_ms: (u32, u32),
}

impl Turns {
    /// Pushes session `session`'s turns over `context`, the first at `start`.
    fn push(
        &self,
        out: &mut Vec<SynthRequest>,
        mut context: Context,
        ids: &mut IdSource,
        rng: &mut SplitMix64,
        session: u64,
        start: f64,
    ) {
        let mut now = start;
        for _ in 0..rng.range(self.count).max(1) {
            context.append(ids, rng.range(self.user_tokens));
            let output = rng.range(self.output_tokens);
            out.push(SynthRequest {
                record: context.record(ids, now, output),
                session_id: session,
                parent_session: None,
            });
            context.append(ids, output);
            now += rng.range(self.gap_ms) as f64;
        }
    }
}

/// A prompt so far: the ids of its full blocks and its length in tokens.
#[derive(Debug, Clone)]
struct Context {
    full: Vec<u64>,
    tokens: u32,
}

impl Context {
    fn fresh(ids: &mut IdSource, tokens: u32) -> Self {
        let mut c = Self {
            full: Vec::new(),
            tokens: 0,
        };
        c.append(ids, tokens);
        c
    }

    /// Appends new content; every block it completes gets a fresh id (a block that was partial
    /// before is new content as a whole).
    fn append(&mut self, ids: &mut IdSource, tokens: u32) {
        self.tokens = self.tokens.saturating_add(tokens);
        let full = self.tokens as usize / MOONCAKE_BLOCK_TOKENS;
        while self.full.len() < full {
            self.full.push(ids.fresh());
        }
    }

    fn record(&self, ids: &mut IdSource, timestamp: f64, output: u32) -> TraceRecord {
        let mut hash_ids = self.full.clone();
        if !(self.tokens as usize).is_multiple_of(MOONCAKE_BLOCK_TOKENS) {
            hash_ids.push(ids.fresh());
        }
        TraceRecord {
            timestamp: timestamp.round(),
            input_length: self.tokens,
            output_length: output,
            hash_ids,
        }
    }
}

/// SplitMix64: tiny, seedable and stable across platforms and releases, which a generator whose
/// output feeds recorded benchmark figures needs more than statistical quality.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        Self(seed ^ 0x6a09_e667_f3bc_c908)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in the inclusive range (bounds in either order).
    fn range(&mut self, (a, b): (u32, u32)) -> u32 {
        let (lo, hi) = (a.min(b), a.max(b));
        lo + (self.next() % (u64::from(hi - lo) + 1)) as u32
    }

    /// An index drawn with the given (positive) weights.
    fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut pick = self.unit() * total;
        weights
            .iter()
            .position(|w| {
                pick -= w;
                pick < 0.0
            })
            .unwrap_or(weights.len().saturating_sub(1))
    }

    fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

#[cfg(test)]
mod tests;
