//! Progress bars (indicatif), drawn only on a terminal and unless quiet.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

/// A bar of `len` steps with `label`, hidden when stderr is not a terminal
/// or `quiet` is set. indicatif draws it only after a short delay, so quick
/// jobs show nothing.
pub fn bar(len: u64, label: &str, quiet: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
    if !quiet && std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::stderr());
    }
    pb.set_style(
        ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {rate} eta {eta}")
            .expect("valid template")
            // indicatif's own {per_sec} prints four decimals.
            .with_key("rate", |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{}/s", crate::plot::number(s.per_sec().round()));
            })
            .progress_chars("=> "),
    );
    pb.set_prefix(label.to_owned());
    pb
}

/// A spinner with `label` for work without a step count, ticking on its own;
/// hidden like [`bar`].
pub fn spinner(label: &str, quiet: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
    if !quiet && std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::stderr());
    }
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"),
    );
    pb.set_message(label.to_owned());
    pb.enable_steady_tick(std::time::Duration::from_millis(120));
    pb
}
