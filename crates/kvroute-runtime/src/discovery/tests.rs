use super::*;

fn set(entries: &[(WorkerId, &str)]) -> BTreeMap<WorkerId, InstanceInfo> {
    entries
        .iter()
        .map(|(id, addr)| (*id, InstanceInfo::new(*id, *addr, 16)))
        .collect()
}

fn check(old: &[(WorkerId, &str)], new: &[(WorkerId, &str)], expect: &[&str]) {
    let got: Vec<String> = diff_instances(&set(old), &set(new))
        .into_iter()
        .map(|e| match e {
            DiscoveryEvent::Added(i) => format!("+{}@{}", i.id, i.address),
            DiscoveryEvent::Removed(id) => format!("-{id}"),
        })
        .collect();
    assert_eq!(got, expect);
}

#[test]
fn diff_lists_removals_then_additions() {
    check(&[], &[], &[]);
    check(&[], &[(2, "b"), (1, "a")], &["+1@a", "+2@b"]);
    check(&[(1, "a"), (2, "b")], &[(2, "b")], &["-1"]);
    check(&[(1, "a")], &[(1, "a2"), (3, "c")], &["+1@a2", "+3@c"]);
    check(&[(1, "a"), (2, "b")], &[(3, "c")], &["-1", "-2", "+3@c"]);
}

#[test]
fn validation_names_the_bad_field() {
    let check = |info: InstanceInfo, expect: &str| {
        let error = validate(&info).unwrap_err().to_string();
        assert!(
            error.contains(expect),
            "{error:?} should mention {expect:?}"
        );
    };
    check(InstanceInfo::new(1, "", 16), "address");
    check(InstanceInfo::new(1, "a:1", 0), "kv_block_size");
    check(InstanceInfo::new(1, "a:1", 16).with_dp_size(0), "dp_size");
    assert!(validate(&InstanceInfo::new(1, "a:1", 16)).is_ok());
}
