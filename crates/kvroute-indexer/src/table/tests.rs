use std::collections::HashMap;

use proptest::prelude::*;

use super::{EMPTY, TAIL, U64Map, unmix};

#[derive(Debug, Clone)]
enum Op {
    Insert(u64, u64),
    Remove(u64),
    Shrink,
}

fn op() -> impl Strategy<Value = Op> {
    // Few distinct keys (including the one kept aside) so removes hit and probe runs collide.
    let key = prop_oneof![Just(unmix(EMPTY)), 0u64..40, any::<u64>()];
    prop_oneof![
        4 => (key.clone(), any::<u64>()).prop_map(|(k, v)| Op::Insert(k, v)),
        3 => key.prop_map(Op::Remove),
        1 => Just(Op::Shrink),
    ]
}

/// Keys whose homes crowd together: a few spots, each with many keys whose mixed hashes lie
/// close, so runs grow long (probes, inserts' shifts and removals' back-shifts go far); the spot
/// at the top of the hash range makes runs spill past the home range into the tail, and grow it
/// (its top key is the one kept aside).
fn crowded_key() -> impl Strategy<Value = u64> {
    let spot = prop_oneof![Just(u64::MAX), Just(u64::MAX / 3), Just(1u64 << 20)];
    (spot, 0u64..(1 << 58)).prop_map(|(spot, off)| unmix(spot.wrapping_sub(off)))
}

fn crowded_op() -> impl Strategy<Value = Op> {
    let key = prop_oneof![crowded_key(), any::<u64>()];
    prop_oneof![
        6 => (key.clone(), any::<u64>()).prop_map(|(k, v)| Op::Insert(k, v)),
        3 => key.prop_map(Op::Remove),
        1 => Just(Op::Shrink),
    ]
}

/// Applies `ops` to a map and to a model, checking after each that they agree and the map's
/// runs are in order; at the end, that every key is found and nothing else is held.
fn check_against_model(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut map = U64Map::default();
    let mut model: HashMap<u64, u64> = HashMap::new();
    for op in ops {
        match op {
            Op::Insert(k, v) => {
                let fresh = map.insert_new(k, v);
                prop_assert_eq!(fresh, !model.contains_key(&k));
                model.entry(k).or_insert(v);
            }
            Op::Remove(k) => prop_assert_eq!(map.remove(k), model.remove(&k)),
            Op::Shrink => map.maybe_shrink(),
        }
        prop_assert_eq!(map.len(), model.len());
        prop_assert!(map.in_order());
    }
    for (k, v) in &model {
        prop_assert_eq!(map.get(*k), Some(*v));
    }
    let mut got: Vec<(u64, u64)> = map.iter().collect();
    got.sort_unstable();
    let mut want: Vec<(u64, u64)> = model.into_iter().collect();
    want.sort_unstable();
    prop_assert_eq!(got, want);
    Ok(())
}

proptest! {
    #[test]
    fn u64map_agrees_with_hashmap(ops in proptest::collection::vec(op(), 0..300)) {
        check_against_model(ops)?;
    }

    /// Long runs, and runs spilling past the home range into a growing tail.
    #[test]
    fn u64map_agrees_with_hashmap_on_crowded_keys(
        ops in proptest::collection::vec(crowded_op(), 0..1500),
    ) {
        check_against_model(ops)?;
    }
}

#[test]
fn crowded_keys_make_long_runs_into_a_grown_tail() {
    // The crowded keys do what their test needs: long runs, one of them spilling past the home
    // range and growing the tail.
    let mut map = U64Map::default();
    let spot = u64::MAX - 1;
    for off in 0..200u64 {
        map.insert_new(unmix(spot - off * (1 << 50)), off);
    }
    let n = map.slots.len();
    let longest = (0..n)
        .map(|i| (i..n).take_while(|&j| map.slots[j].0 != EMPTY).count())
        .max()
        .unwrap_or(0);
    assert!(longest > 64, "longest run {longest}");
    assert!(
        n > map.homes + TAIL,
        "the tail grew: {n} slots, {} homes",
        map.homes
    );
    assert!(map.in_order());
    for off in 0..200u64 {
        assert_eq!(map.get(unmix(spot - off * (1 << 50))), Some(off));
    }
    for off in 0..200u64 {
        assert_eq!(map.remove(unmix(spot - off * (1 << 50))), Some(off));
        assert!(map.in_order());
    }
    assert!(map.is_empty());
}

#[test]
fn unmix_undoes_the_mix() {
    for key in [0, 1, 2, 12345, u64::MAX, 1 << 63] {
        assert_eq!(unmix(super::mix(key)), key);
    }
}

#[test]
fn churn_keeps_the_table_size() {
    let mut map = U64Map::default();
    for k in 1..=1000u64 {
        map.insert_new(k, k);
    }
    let size = map.bytes();
    for k in 1001..200_000u64 {
        map.insert_new(k, k);
        assert_eq!(map.remove(k - 1000), Some(k - 1000));
    }
    assert_eq!(map.len(), 1000);
    assert_eq!(map.bytes(), size);
}
