//! The demo's generated workload: multi-turn conversations over a few shared system prompts.
//!
//! Everything here is a pure function of a [`WorkloadSpec`] (its seed included), so two runs of
//! the demo, and the two policies of one run, send exactly the same conversations. Texts are
//! made of pseudo-words, which the mock model's tokenizer turns into one token each, so a word
//! count is a token count and prompts that share leading words share leading KV blocks.

use std::time::Duration;

use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The shape of the workload.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WorkloadSpec {
    /// Conversations (one simulated user each).
    pub(crate) conversations: usize,
    /// Turns per conversation.
    pub(crate) turns: usize,
    /// Distinct system prompts the conversations share.
    pub(crate) system_prompts: usize,
    /// Words (tokens) of one system prompt.
    pub(crate) system_words: usize,
    /// Words of one user message: a uniform draw from this range.
    pub(crate) user_words: (usize, usize),
    /// `max_tokens` of one turn: a uniform draw from this range.
    pub(crate) reply_tokens: (u32, u32),
    /// Mean gap between two conversations' starts, in modelled time (exponential gaps).
    pub(crate) arrival_gap: Duration,
    /// A user's pause between a reply and their next message, in modelled time: a uniform draw
    /// from this range.
    pub(crate) think_time: (Duration, Duration),
    /// The seed of every draw.
    pub(crate) seed: u64,
}

/// One generated workload.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Workload {
    /// The shared system prompts.
    pub(crate) system_prompts: Vec<String>,
    /// The conversations, in order of their start.
    pub(crate) conversations: Vec<Conversation>,
}

/// One user's conversation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Conversation {
    /// Its index in [`Workload::conversations`].
    pub(crate) id: usize,
    /// Which system prompt it opens with.
    pub(crate) system: usize,
    /// When it starts, in modelled time since the run began.
    pub(crate) start: Duration,
    /// Its turns, in order.
    pub(crate) turns: Vec<Turn>,
}

/// One user message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Turn {
    /// The user's message.
    pub(crate) user: String,
    /// The reply's `max_tokens`.
    pub(crate) max_tokens: u32,
    /// The pause before sending it (zero on the first turn), in modelled time.
    pub(crate) think: Duration,
}

impl Workload {
    /// Generates the workload `spec` describes.
    pub(crate) fn generate(spec: &WorkloadSpec) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
        let system_prompts = (0..spec.system_prompts.max(1))
            .map(|_| words(&mut rng, spec.system_words))
            .collect::<Vec<_>>();
        let mut start = Duration::ZERO;
        let conversations = (0..spec.conversations)
            .map(|id| {
                if id > 0 {
                    // Exponential gaps: conversations arrive as a Poisson process.
                    let u: f64 = rng.gen_range(f64::EPSILON..1.0);
                    start += spec.arrival_gap.mul_f64(-u.ln());
                }
                let system = rng.gen_range(0..system_prompts.len());
                let turns = (0..spec.turns)
                    .map(|t| Turn {
                        user: {
                            let n = draw(&mut rng, spec.user_words);
                            words(&mut rng, n)
                        },
                        max_tokens: {
                            let (lo, hi) = spec.reply_tokens;
                            rng.gen_range(lo.max(1)..=hi.max(lo.max(1)))
                        },
                        think: if t == 0 {
                            Duration::ZERO
                        } else {
                            let (lo, hi) = spec.think_time;
                            lo + (hi.saturating_sub(lo)).mul_f64(rng.r#gen::<f64>())
                        },
                    })
                    .collect();
                Conversation {
                    id,
                    system,
                    start,
                    turns,
                }
            })
            .collect();
        Self {
            system_prompts,
            conversations,
        }
    }

    /// Requests in the whole workload.
    pub(crate) fn requests(&self) -> usize {
        self.conversations.iter().map(|c| c.turns.len()).sum()
    }
}

/// A chat message as the demo sends it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Message {
    /// `system`, `user` or `assistant`.
    pub(crate) role: &'static str,
    /// The text.
    pub(crate) content: String,
}

/// The messages of turn `turn` of `conversation`: the system prompt, every earlier user message
/// with its reply from `replies`, then this turn's user message. Each turn's prompt therefore
/// extends the previous one.
pub(crate) fn messages(
    workload: &Workload,
    conversation: &Conversation,
    turn: usize,
    replies: &[String],
) -> Vec<Message> {
    let mut out = vec![Message {
        role: "system",
        content: workload.system_prompts[conversation.system].clone(),
    }];
    for (t, reply) in conversation.turns[..turn].iter().zip(replies) {
        out.push(Message {
            role: "user",
            content: t.user.clone(),
        });
        out.push(Message {
            role: "assistant",
            content: reply.clone(),
        });
    }
    out.push(Message {
        role: "user",
        content: conversation.turns[turn].user.clone(),
    });
    out
}

fn draw(rng: &mut ChaCha8Rng, (lo, hi): (usize, usize)) -> usize {
    rng.gen_range(lo.max(1)..=hi.max(lo.max(1)))
}

const CONSONANTS: &[u8] = b"bcdfghjklmnpqrstvwxz";
const VOWELS: &[u8] = b"aeiouy";

/// `n` pseudo-words of two to four syllables, joined by spaces.
fn words(rng: &mut ChaCha8Rng, n: usize) -> String {
    let mut text = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            text.push(' ');
        }
        for _ in 0..rng.gen_range(2..=4) {
            text.push(char::from(CONSONANTS[rng.gen_range(0..CONSONANTS.len())]));
            text.push(char::from(VOWELS[rng.gen_range(0..VOWELS.len())]));
        }
    }
    text
}

#[cfg(test)]
mod tests;
