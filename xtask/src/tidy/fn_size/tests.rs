use super::*;

/// Scans `source` and compares the functions found, as (name, lines), with `expect`.
fn check(source: &str, expect: &[(&str, usize)]) {
    let found: Vec<(String, usize)> = functions(source)
        .into_iter()
        .map(|f| (f.name, f.lines))
        .collect();
    let expect: Vec<(String, usize)> = expect.iter().map(|&(n, l)| (n.to_owned(), l)).collect();
    assert_eq!(found, expect, "in:\n{source}");
}

#[test]
fn no_function_is_over_the_limit_but_the_listed_ones() {
    let problems = check_workspace();
    assert!(problems.is_empty(), "{problems:#?}");
}

fn check_workspace() -> Vec<String> {
    super::check(&crate::tidy::workspace_metadata())
}

#[test]
fn a_function_runs_from_its_fn_line_to_its_closing_brace() {
    check("fn one() {}\n", &[("one", 1)]);
    check(
        "/// Doc.\n#[inline]\npub(crate) async fn two<'a, T: Fn(u32) -> u32>(\n    x: &'a T,\n) -> u32\nwhere\n    T: Send,\n{\n    x(1)\n}\n",
        &[("two", 8)],
    );
    check(
        "impl A {\n    fn outer(&self) {\n        fn inner() {\n        }\n    }\n}\n",
        &[("outer", 4), ("inner", 2)],
    );
}

#[test]
fn braces_in_comments_strings_and_chars_do_not_count() {
    check(
        "fn f() {\n    // }\n    /* } /* nested } */ } */\n    let s = \"}\\\"}\";\n    let c = '}';\n    let q = '\\'';\n    let r = r#\"}\"\"}\"#;\n    let b = b'{';\n}\nfn g() {}\n",
        &[("f", 9), ("g", 1)],
    );
}

#[test]
fn lifetimes_and_labels_are_not_char_literals() {
    check(
        "fn f<'a>(x: &'a str) -> &'static str {\n    'outer: loop { break 'outer; }\n    \"{\"\n}\n",
        &[("f", 4)],
    );
}

#[test]
fn declarations_fn_types_and_test_modules_are_skipped() {
    check(
        "trait T {\n    fn declared(&self);\n    fn provided(&self) {}\n}\ntype F = fn(u32) -> u32;\nfn kept(x: [u8; 4]) -> [u8; 2] {}\n#[cfg(test)]\nmod tests;\n#[cfg(test)]\nmod inline {\n    fn helper() {\n    }\n}\n",
        &[("provided", 1), ("kept", 1)],
    );
}

#[test]
fn long_functions_fail_unless_listed_and_the_list_only_shrinks() {
    let f = |name: &str, lines| Function {
        name: name.to_owned(),
        line: 1,
        lines,
    };
    let functions = [
        ("crates/a/src/lib.rs".to_owned(), f("short", MAX_LINES)),
        ("crates/a/src/lib.rs".to_owned(), f("long", MAX_LINES + 1)),
        ("crates/a/src/lib.rs".to_owned(), f("listed", 2 * MAX_LINES)),
        ("crates/a/src/lib.rs".to_owned(), f("split", 10)),
    ];
    assert_eq!(
        check_lengths(&functions, &[("crates/a/src/lib.rs", "listed")]),
        [
            "crates/a/src/lib.rs:1: fn long has 121 lines, more than 120: split it into helpers \
             (xtask/src/tidy/fn_size.rs lists the functions still over, and takes no new ones)"
        ]
    );
    let problems = check_lengths(
        &functions,
        &[
            ("crates/a/src/lib.rs", "long"),
            ("crates/a/src/lib.rs", "listed"),
            ("crates/a/src/lib.rs", "split"),
            ("crates/a/src/gone.rs", "gone"),
        ],
    );
    assert_eq!(problems.len(), 2, "{problems:#?}");
    assert!(
        problems[0].contains("names fn split of crates/a/src/lib.rs"),
        "{problems:#?}"
    );
    assert!(
        problems[1].contains("names fn gone of crates/a/src/gone.rs"),
        "{problems:#?}"
    );
}
