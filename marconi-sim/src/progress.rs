//! Progress bars (indicatif), unless quiet: drawn in place on a terminal;
//! when stderr is not a terminal (a CI log, a file), one line every
//! [`LOG_EVERY`] instead, so long runs show they are alive.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle, TermLike};

/// How often a progress line is printed when stderr is not a terminal.
pub const LOG_EVERY: Duration = Duration::from_secs(5);

/// A bar of `len` steps with `label`, hidden when `quiet` is set. On a
/// terminal indicatif draws it only after a short delay, so quick jobs show
/// nothing; elsewhere a line is printed every [`LOG_EVERY`], the first after
/// that long.
pub fn bar(len: u64, label: &str, quiet: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
    pb.set_draw_target(target(quiet));
    pb.set_style(
        ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {rate} eta {mean_eta}")
            .expect("valid template")
            // indicatif's own {per_sec} prints four decimals.
            .with_key("rate", |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = write!(w, "{}/s", crate::plot::number(s.per_sec().round()));
            })
            // indicatif's {eta} follows the rate of the last few seconds,
            // which a burst of cheap steps (a fast policy finishing) makes
            // say 1 s with 15 s to go; this one uses the mean rate so far.
            .with_key(
                "mean_eta",
                |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = write!(
                        w,
                        "{}",
                        mean_eta(s.pos(), s.len(), s.elapsed()).map_or("?".to_owned(), format_secs)
                    );
                },
            )
            .progress_chars("=> "),
    );
    pb.set_prefix(label.to_owned());
    pb
}

/// A spinner with `label` for work without a step count, ticking on its own;
/// shown like [`bar`].
pub fn spinner(label: &str, quiet: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
    pb.set_draw_target(target(quiet));
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}").expect("valid template"),
    );
    pb.set_message(label.to_owned());
    pb.enable_steady_tick(std::time::Duration::from_millis(120));
    pb
}

fn target(quiet: bool) -> ProgressDrawTarget {
    if quiet {
        ProgressDrawTarget::hidden()
    } else if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::term_like_with_hz(Box::new(LogLines::new(LOG_EVERY)), 1)
    }
}

/// Seconds left at the mean rate since the start: `None` before the first
/// step or without a length.
pub fn mean_eta(pos: u64, len: Option<u64>, elapsed: Duration) -> Option<Duration> {
    let len = len?;
    if pos == 0 {
        return None;
    }
    let left = len.saturating_sub(pos) as f64;
    Some(Duration::from_secs_f64(
        elapsed.as_secs_f64() * left / pos as f64,
    ))
}

/// `42s`, `3m05s`, `1h02m`.
pub fn format_secs(d: Duration) -> String {
    let s = d.as_secs_f64().round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// A terminal stand-in for logs: every drawn line goes to stderr as a plain
/// line, at most once per `every`; cursor moves and clears are dropped.
#[derive(Debug)]
struct LogLines {
    every: Duration,
    last: Mutex<Instant>,
}

impl LogLines {
    fn new(every: Duration) -> Self {
        Self {
            every,
            last: Mutex::new(Instant::now()),
        }
    }

    fn line(&self, s: &str) -> std::io::Result<()> {
        let s = s.trim_end();
        if s.is_empty() {
            return Ok(());
        }
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() < self.every {
            return Ok(());
        }
        *last = Instant::now();
        eprintln!("{s}");
        Ok(())
    }
}

impl TermLike for LogLines {
    fn width(&self) -> u16 {
        100
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.line(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        self.line(s)
    }
    fn clear_line(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eta_follows_the_mean_rate_not_the_last_burst() {
        // 3,000 of 4,000 steps in 45 s: 15 s left at the mean rate, however
        // fast the last steps came.
        let eta = mean_eta(3_000, Some(4_000), Duration::from_secs(45)).unwrap();
        assert_eq!(format_secs(eta), "15s");
        assert_eq!(mean_eta(0, Some(10), Duration::from_secs(3)), None);
        assert_eq!(mean_eta(5, None, Duration::from_secs(3)), None);
        assert_eq!(
            mean_eta(10, Some(10), Duration::from_secs(3)),
            Some(Duration::ZERO)
        );
        assert_eq!(format_secs(Duration::from_secs(185)), "3m05s");
        assert_eq!(format_secs(Duration::from_secs(3_720)), "1h02m");
    }

    #[test]
    fn log_lines_print_at_most_once_per_period() {
        let log = LogLines::new(Duration::from_secs(3_600));
        // Within the period nothing is printed (and nothing fails); the
        // period starts at creation, so a quick job logs nothing.
        log.write_line("replaying [==>   ] 1/10").unwrap();
        assert!(log.last.lock().unwrap().elapsed() < Duration::from_secs(3_600));
        let log = LogLines::new(Duration::ZERO);
        let before = *log.last.lock().unwrap();
        log.write_line("replaying [==>   ] 2/10").unwrap();
        assert!(
            *log.last.lock().unwrap() > before,
            "a line after the period moves the clock"
        );
        let t = *log.last.lock().unwrap();
        log.write_line("   ").unwrap();
        assert_eq!(*log.last.lock().unwrap(), t, "blank lines are not printed");
    }
}
