use super::StopMatcher;

/// Feeds `pieces` through a matcher of `stops`; returns every piece's output, the end's, and
/// whether it matched.
fn check(stops: &[&str], include: bool, pieces: &[&str], expect: (&[&str], &str, bool)) {
    let stops: Vec<String> = stops.iter().map(|s| (*s).to_owned()).collect();
    let mut m = StopMatcher::new(&stops, include);
    let out: Vec<String> = pieces.iter().map(|p| m.push(p)).collect();
    let end = m.finish();
    let got: Vec<&str> = out.iter().map(String::as_str).collect();
    assert_eq!(
        (got.as_slice(), end.as_str(), m.matched()),
        expect,
        "stops {stops:?} include {include} pieces {pieces:?}"
    );
}

#[test]
fn no_stop_strings_pass_everything_at_once() {
    check(&[], false, &["a", "b"], (&["a", "b"], "", false));
    check(&[""], false, &["a"], (&["a"], "", false));
}

#[test]
fn text_before_a_stop_string_is_sent_and_the_rest_is_not() {
    check(
        &["ladete"],
        false,
        &["hello la", "dete more", "even more"],
        (&["hello ", "", ""], "", true),
    );
    // With include_stop_str_in_output the stop string is part of the text.
    check(
        &["ladete"],
        true,
        &["hello la", "dete more"],
        (&["hello ", "ladete"], "", true),
    );
}

#[test]
fn a_stop_string_split_across_many_pieces_is_found() {
    check(
        &["STOP"],
        false,
        &["xS", "T", "O", "Py"],
        (&["x", "", "", ""], "", true),
    );
}

#[test]
fn a_held_back_prefix_that_does_not_become_a_stop_string_is_released() {
    check(
        &["STOP"],
        false,
        &["xST", "ay"],
        (&["x", "STay"], "", false),
    );
    // Held back at the end of the stream: sent then.
    check(&["STOP"], false, &["xSTO"], (&["x"], "STO", false));
}

#[test]
fn the_earliest_stop_string_wins_and_of_two_at_once_the_longer() {
    check(&["b", "a"], false, &["xab"], (&["x"], "", true));
    check(&["ab", "abc"], true, &["xabcd"], (&["xabc"], "", true));
}

#[test]
fn multibyte_text_is_cut_on_character_boundaries() {
    check(&["é!"], false, &["café", "!ok"], (&["caf", ""], "", true));
    check(
        &["日本"],
        false,
        &["こんに日", "はい"],
        (&["こんに", "日はい"], "", false),
    );
}
