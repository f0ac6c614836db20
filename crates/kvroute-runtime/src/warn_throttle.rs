//! [`WarnThrottle`]: one warning per window for a failure that repeats, with a count of the rest.

use std::fmt;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long a [`WarnThrottle`] stays quiet after logging, unless told otherwise.
pub const DEFAULT_WARN_WINDOW: Duration = Duration::from_secs(10);

/// Rate-limits a warning that can repeat many times a second (a publish failing for every event
/// while NATS is down): the first occurrence is logged at once, later ones within the window
/// are only counted, and the first occurrence after the window is logged with that count. A
/// caller whose failures stop calls [`WarnThrottle::flush`] on its next success (or timer), so
/// the count of the last burst is not lost.
///
/// It keeps no clock: every call takes `now`, so tests drive it in virtual time. Share it by
/// reference; it locks internally.
///
/// ```
/// use std::time::{Duration, Instant};
/// use kvroute_runtime::WarnThrottle;
///
/// let throttle = WarnThrottle::new(Duration::from_secs(10));
/// let t0 = Instant::now();
/// for i in 0..100 {
///     let now = t0 + Duration::from_millis(i * 10);
///     if let Some(more) = throttle.check(now) {
///         // Logged once, at i == 0, with nothing suppressed before it.
///         assert_eq!((i, more.count()), (0, 0));
///         eprintln!("publishing failed{more}");
///     }
/// }
/// let more = throttle.check(t0 + Duration::from_secs(11)).unwrap();
/// assert_eq!(more.to_string(), " (99 more like this in the last 11 s)");
/// ```
#[derive(Debug)]
pub struct WarnThrottle {
    window: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// When the last line was logged (none yet: the next occurrence is logged).
    logged: Option<Instant>,
    /// Occurrences counted, not logged, since then.
    suppressed: u64,
}

/// The occurrences a logged line stands for besides itself. Its `Display` is empty when there
/// were none, else ` (N more like this in the last S s)`, to append to the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suppressed {
    count: u64,
    over: Duration,
}

impl Suppressed {
    /// How many occurrences were not logged.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Over how long (since the previous logged line).
    pub fn over(&self) -> Duration {
        self.over
    }
}

impl fmt::Display for Suppressed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.count == 0 {
            return Ok(());
        }
        // Whole seconds, rounded up: "in the last 0 s" would read as nothing.
        let secs = self.over.as_millis().div_ceil(1000).max(1);
        write!(f, " ({} more like this in the last {secs} s)", self.count)
    }
}

impl WarnThrottle {
    /// A throttle that logs at most once per `window`.
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            state: Mutex::new(State::default()),
        }
    }

    /// Records an occurrence at `now`: `Some` when it is to be logged (the first one, or the
    /// first one a whole window after the last logged), carrying what was suppressed since.
    pub fn check(&self, now: Instant) -> Option<Suppressed> {
        let mut state = self.state.lock();
        match state.logged {
            Some(at) if now.saturating_duration_since(at) < self.window => {
                state.suppressed += 1;
                None
            }
            logged => {
                let over = logged.map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
                let count = std::mem::take(&mut state.suppressed);
                state.logged = Some(now);
                Some(Suppressed { count, over })
            }
        }
    }

    /// The occurrences suppressed since the last logged line, once a whole window has passed
    /// since it (`None` while it has not, or when nothing was suppressed); they are then
    /// reported and the window restarts at `now`.
    pub fn flush(&self, now: Instant) -> Option<Suppressed> {
        let mut state = self.state.lock();
        let at = state.logged?;
        let over = now.saturating_duration_since(at);
        if state.suppressed == 0 || over < self.window {
            return None;
        }
        let count = std::mem::take(&mut state.suppressed);
        state.logged = Some(now);
        Some(Suppressed { count, over })
    }
}

impl Default for WarnThrottle {
    fn default() -> Self {
        Self::new(DEFAULT_WARN_WINDOW)
    }
}

#[cfg(test)]
mod tests;
