use std::time::Duration;

use super::HumanDuration;

#[test]
fn durations_take_a_unit() {
    let parse = |s: &str| s.parse::<HumanDuration>().map(|d| d.0);
    assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
    assert_eq!(parse("5s"), Ok(Duration::from_secs(5)));
    assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
    assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
    assert!(parse("1.5s").is_err());
    assert!(parse("s").is_err());
}

#[test]
fn a_duration_shown_as_a_default_parses_back_to_itself() {
    for (duration, text) in [
        (Duration::from_secs(5), "5s"),
        (Duration::from_secs(300), "300s"),
        (Duration::from_millis(250), "250ms"),
        (Duration::from_millis(1500), "1500ms"),
        (Duration::ZERO, "0s"),
    ] {
        let shown = HumanDuration(duration).to_string();
        assert_eq!(shown, text);
        assert_eq!(shown.parse(), Ok(HumanDuration(duration)));
    }
}
