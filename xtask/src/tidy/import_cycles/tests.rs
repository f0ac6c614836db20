use super::*;

/// The circles among `files` (path relative to `src/`, text), each as `a.rs -> b.rs -> a.rs`.
fn circles(files: &[(&str, &str)]) -> Vec<String> {
    let files: Vec<(String, String)> = files
        .iter()
        .map(|&(path, text)| (path.to_owned(), text.to_owned()))
        .collect();
    cycles(&files).iter().map(|c| c.join(" -> ")).collect()
}

/// The module paths `source`, in the file of module `file` (`a::b`), refers to, as `a::b`.
fn referenced(source: &str, file: &str) -> Vec<String> {
    let file: ModPath = file
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    referenced_paths(source, &file)
        .iter()
        .map(|p| p.join("::"))
        .collect()
}

#[test]
fn no_crate_has_files_importing_each_other_in_a_circle() {
    let problems = check(&crate::tidy::workspace_metadata());
    assert!(problems.is_empty(), "{problems:#?}");
}

#[test]
fn files_map_to_module_paths() {
    let path = |file| module_path(file).map(|p| p.join("::"));
    assert_eq!(path("lib.rs").as_deref(), Some(""));
    assert_eq!(path("main.rs").as_deref(), Some(""));
    assert_eq!(path("a.rs").as_deref(), Some("a"));
    assert_eq!(path("a/mod.rs").as_deref(), Some("a"));
    assert_eq!(path("a/b.rs").as_deref(), Some("a::b"));
    assert_eq!(path("a/lib.rs").as_deref(), Some("a::lib"));
    assert_eq!(path("a/notes.md"), None);
}

#[test]
fn paths_resolve_from_the_module_they_are_written_in() {
    assert_eq!(
        referenced("use crate::a::B;\nfn f() { crate::c::d::f(); }\n", "x::y"),
        ["a::B", "c::d::f"]
    );
    assert_eq!(referenced("use super::b::C;\n", "a::x"), ["a::b::C"]);
    assert_eq!(referenced("use super::b::C;\n", "a"), ["b::C"]);
    assert_eq!(referenced("use super::super::b;\n", "a::x::y"), ["a::b"]);
    assert_eq!(referenced("use self::child::C;\n", "a"), ["a::child::C"]);
    assert_eq!(
        referenced("mod inner {\n    use super::b;\n    use self::c;\n}\n", "a"),
        ["a::b", "a::inner::c"]
    );
    assert_eq!(
        referenced(
            "fn f(x: super::b::T) -> Vec<super::c::U> { $crate::d::g() }\n",
            "a::x"
        ),
        ["a::b::T", "a::c::U", "d::g"]
    );
}

#[test]
fn use_trees_give_one_path_per_leaf() {
    assert_eq!(
        referenced(
            "use crate::{a, b::{self, c::D as E}, f::*};\nuse super::{g::{h, i}};\n",
            "x::y"
        ),
        ["a", "b", "b::c::D", "f", "x::g::h", "x::g::i"]
    );
}

#[test]
fn comments_strings_visibilities_and_tests_are_no_references() {
    let source = "\
//! See [`crate::a`].
/// Uses [`super::b`].
// use crate::c;
/* use crate::d; */
pub(in crate::e) fn f() -> &'static str {
    \"crate::g::h\"
}
pub(super) fn i() {}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::j;
}
";
    assert_eq!(referenced(source, "x::y"), Vec::<String>::new());
}

#[test]
fn two_files_using_each_other_are_a_circle() {
    assert_eq!(
        circles(&[
            ("lib.rs", "mod a;\nmod b;\npub use a::A;\n"),
            ("a.rs", "use crate::b::B;\npub struct A(B);\n"),
            (
                "b.rs",
                "pub struct B;\nfn f() -> super::a::A { super::a::A }\n"
            ),
        ]),
        ["a.rs -> b.rs -> a.rs"]
    );
    assert_eq!(
        circles(&[
            ("main.rs", "mod serve;\n"),
            (
                "serve/mod.rs",
                "mod http;\nuse self::http::Sim;\npub(crate) struct Job;\n"
            ),
            ("serve/http.rs", "use crate::serve::{Job, self};\n"),
        ]),
        ["serve/http.rs -> serve/mod.rs -> serve/http.rs"]
    );
}

#[test]
fn a_longer_circle_is_named_once_by_a_shortest_cycle() {
    assert_eq!(
        circles(&[
            ("lib.rs", ""),
            ("a.rs", "use crate::b::B;\nuse crate::d::D;\n"),
            ("b.rs", "use crate::c::C;\n"),
            ("c.rs", "use crate::a::A;\nuse crate::d::D;\n"),
            ("d.rs", "use crate::c::C;\n"),
            ("e.rs", "use crate::a::A;\n"),
        ]),
        ["c.rs -> d.rs -> c.rs"]
    );
    assert_eq!(
        circles(&[
            ("a.rs", "use crate::b::B;\n"),
            ("b.rs", "use crate::c::C;\n"),
            ("c.rs", "use crate::a::A;\n"),
            ("d.rs", "use crate::e::E;\n"),
            ("e.rs", "use crate::d::D;\n"),
        ]),
        ["a.rs -> b.rs -> c.rs -> a.rs", "d.rs -> e.rs -> d.rs"]
    );
    assert_eq!(
        circle_problems(
            "crates/x/src",
            &[
                ("a.rs".to_owned(), "use crate::b::B;\n".to_owned()),
                ("b.rs".to_owned(), "use crate::a::A;\n".to_owned()),
            ]
        ),
        [
            "crates/x/src: files import each other in a circle: a.rs -> b.rs -> a.rs; move \
             what both need into one of them or a third module"
        ]
    );
}

#[test]
fn declarations_the_root_and_one_way_imports_are_no_circle() {
    assert_eq!(
        circles(&[
            // The root declares and re-exports; everyone uses the root's facade.
            (
                "lib.rs",
                "mod a;\nmod b;\npub use a::A;\npub use crate::b::B;\n"
            ),
            ("a.rs", "use crate::B;\nuse crate::b::helper;\nmod child;\n"),
            ("a/child.rs", "use super::A;\nuse crate::A as Root;\n"),
            ("b.rs", "use crate::A;\npub fn helper() {}\n"),
            // Paths to itself are no edge.
            ("c.rs", "use self::X;\nuse crate::c::Y;\n"),
        ]),
        Vec::<String>::new()
    );
}
