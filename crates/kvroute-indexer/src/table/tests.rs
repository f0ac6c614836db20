use std::collections::HashMap;

use proptest::prelude::*;

use super::U64Map;

#[derive(Debug, Clone)]
enum Op {
    Insert(u64, u64),
    Remove(u64),
    Shrink,
}

fn op() -> impl Strategy<Value = Op> {
    // Few distinct keys (including 0) so removes hit and probe runs collide.
    let key = prop_oneof![Just(0u64), 1u64..40, any::<u64>()];
    prop_oneof![
        4 => (key.clone(), any::<u64>()).prop_map(|(k, v)| Op::Insert(k, v)),
        3 => key.prop_map(Op::Remove),
        1 => Just(Op::Shrink),
    ]
}

proptest! {
    #[test]
    fn u64map_agrees_with_hashmap(ops in proptest::collection::vec(op(), 0..300)) {
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
