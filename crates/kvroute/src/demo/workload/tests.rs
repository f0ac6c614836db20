use std::time::Duration;

use super::*;

fn spec(seed: u64) -> WorkloadSpec {
    WorkloadSpec {
        conversations: 12,
        turns: 3,
        system_prompts: 3,
        system_words: 50,
        user_words: (5, 9),
        reply_tokens: (4, 8),
        arrival_gap: Duration::from_millis(100),
        think_time: (Duration::from_millis(10), Duration::from_millis(20)),
        seed,
    }
}

#[test]
fn the_same_seed_gives_the_same_workload_and_another_seed_another() {
    assert_eq!(Workload::generate(&spec(7)), Workload::generate(&spec(7)));
    assert_ne!(Workload::generate(&spec(7)), Workload::generate(&spec(8)));
}

#[test]
fn sizes_and_ranges_follow_the_spec() {
    let w = Workload::generate(&spec(1));
    assert_eq!(w.system_prompts.len(), 3);
    assert!(
        w.system_prompts
            .iter()
            .all(|p| p.split_whitespace().count() == 50)
    );
    assert_eq!(w.conversations.len(), 12);
    assert_eq!(w.requests(), 36);
    let mut last_start = Duration::ZERO;
    for c in &w.conversations {
        assert!(c.system < 3);
        assert!(c.start >= last_start, "conversations are ordered by start");
        last_start = c.start;
        for (t, turn) in c.turns.iter().enumerate() {
            let n = turn.user.split_whitespace().count();
            assert!((5..=9).contains(&n), "{n} user words");
            assert!((4..=8).contains(&turn.max_tokens));
            if t == 0 {
                assert_eq!(turn.think, Duration::ZERO);
            } else {
                assert!(turn.think >= Duration::from_millis(10));
                assert!(turn.think <= Duration::from_millis(20));
            }
        }
    }
    // Several conversations share each system prompt, which is what prefix caching exploits.
    let used: std::collections::BTreeSet<usize> =
        w.conversations.iter().map(|c| c.system).collect();
    assert!(used.len() > 1, "{used:?}");
}

#[test]
fn each_turn_extends_the_previous_turns_messages() {
    let w = Workload::generate(&spec(3));
    let c = &w.conversations[0];
    let replies = ["first reply".to_owned(), "second reply".to_owned()];
    let first = messages(&w, c, 0, &replies[..0]);
    let second = messages(&w, c, 1, &replies[..1]);
    let third = messages(&w, c, 2, &replies[..2]);
    let roles = |m: &[Message]| m.iter().map(|m| m.role).collect::<Vec<_>>();
    assert_eq!(roles(&first), ["system", "user"]);
    assert_eq!(
        roles(&third),
        ["system", "user", "assistant", "user", "assistant", "user"]
    );
    assert_eq!(first[..], second[..2]);
    assert_eq!(second[..], third[..4]);
    assert_eq!(second[2].content, "first reply");
    assert_eq!(first[0].content, w.system_prompts[c.system]);
}
