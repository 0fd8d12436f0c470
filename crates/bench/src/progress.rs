//! Progress on stderr: a bar on a terminal, plain lines in logs and CI.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::time::Instant;

/// Progress of `total` units of work (operations, rounds, ...). On a terminal it draws an
/// indicatif bar; otherwise it prints a plain line at every tenth of the work, on every
/// message, and at the end, so logs stay short.
pub struct Progress {
    label: String,
    total: u64,
    done: u64,
    started: Instant,
    output: Output,
}

enum Output {
    Bar(ProgressBar),
    Lines {
        out: Box<dyn Write + Send>,
        printed_tenths: u64,
    },
}

impl Progress {
    pub fn new(total: u64, label: &str) -> Progress {
        let output = if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total);
            let style =
                ProgressStyle::with_template("{prefix} {wide_bar} {pos}/{len} {elapsed} {msg}")
                    .expect("the progress template is valid");
            bar.set_style(style);
            bar.set_prefix(label.to_string());
            Output::Bar(bar)
        } else {
            Output::Lines {
                out: Box::new(std::io::stderr()),
                printed_tenths: 0,
            }
        };
        Progress::with_output(total, label, output)
    }

    fn with_output(total: u64, label: &str, output: Output) -> Progress {
        Progress {
            label: label.to_string(),
            total,
            done: 0,
            started: Instant::now(),
            output,
        }
    }

    /// Marks `units` more units of work done.
    pub fn inc(&mut self, units: u64) {
        self.done += units;
        let tenths = (self.done * 10)
            .checked_div(self.total)
            .unwrap_or(0)
            .min(10);
        match &mut self.output {
            Output::Bar(bar) => bar.inc(units),
            Output::Lines { printed_tenths, .. } if tenths > *printed_tenths => {
                *printed_tenths = tenths;
                let line = format!("{}/{} ({}%)", self.done, self.total, tenths * 10);
                self.line(&line);
            }
            Output::Lines { .. } => {}
        }
    }

    /// Shows what is being done now, e.g. `"killing primary"`.
    pub fn set_message(&mut self, message: &str) {
        match &self.output {
            Output::Bar(bar) => bar.set_message(message.to_string()),
            Output::Lines { .. } => self.line(message),
        }
    }

    /// Ends the progress display, reporting the elapsed time.
    pub fn finish(mut self) {
        let line = format!(
            "done {}/{} in {:.1} s",
            self.done,
            self.total,
            self.started.elapsed().as_secs_f64()
        );
        match &self.output {
            Output::Bar(bar) => bar.finish_with_message(line),
            Output::Lines { .. } => self.line(&line),
        }
    }

    fn line(&mut self, text: &str) {
        if let Output::Lines { out, .. } = &mut self.output {
            // Progress is a courtesy: a closed stderr must not stop the benchmark.
            let _ = writeln!(out, "{}: {text}", self.label);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct SharedBuffer(Arc<Mutex<Vec<u8>>>);

    impl Write for SharedBuffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().write(bytes)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn plain_lines_at_each_tenth_and_on_messages() {
        let buffer = SharedBuffer::default();
        let output = Output::Lines {
            out: Box::new(buffer.clone()),
            printed_tenths: 0,
        };
        let mut progress = Progress::with_output(1000, "cow", output);
        for _ in 0..1000 {
            progress.inc(1);
        }
        progress.set_message("killing primary");
        progress.finish();
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 12, "{text}");
        assert_eq!(lines[0], "cow: 100/1000 (10%)");
        assert_eq!(lines[9], "cow: 1000/1000 (100%)");
        assert_eq!(lines[10], "cow: killing primary");
        assert!(lines[11].starts_with("cow: done 1000/1000 in "), "{text}");
    }
}
