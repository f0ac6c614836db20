use std::time::Duration;

use super::{cdf_points, escape, nice_ticks};

#[test]
fn ticks_fall_on_round_numbers() {
    assert_eq!(nice_ticks(0.0, 3546.0), vec![0.0, 1000.0, 2000.0, 3000.0]);
    assert_eq!(
        nice_ticks(0.0, 1.0),
        vec![0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]
    );
    assert_eq!(nice_ticks(5.0, 5.0), vec![5.0]);
}

#[test]
fn cdf_ends_at_one_and_climbs() {
    let samples: Vec<Duration> = (1..=1000).map(Duration::from_millis).collect();
    let points = cdf_points(&samples);
    assert_eq!(points.len(), 400);
    assert_eq!(points.last(), Some(&(1000.0, 1.0)));
    assert!(
        points
            .windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1)
    );
    assert!(cdf_points(&[]).is_empty());
}

#[test]
fn text_is_escaped() {
    assert_eq!(escape("a<b>&\"c\""), "a&lt;b&gt;&amp;&quot;c&quot;");
}
