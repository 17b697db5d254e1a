//! A reward computed by an external program that stays running for the whole run.
//!
//! Protocol: for each sample one JSON line on the program's stdin (see
//! [`RewardInput::to_json`]); for each line read, one line on its stdout holding the score (a
//! JSON number or `{"score": x}`), in order. A batch's lines are all written before its
//! answers are read (a reader thread drains stdout meanwhile, so neither side blocks). The
//! program's stderr is kept (its last lines) for the error message when it fails. A line the
//! program was not asked for (a banner, a debug print, a second answer to one request) would
//! shift every later score by one, so it is an error naming the program and the line: lines
//! left over before a batch is sent, or arriving just after its answers were read.

use std::sync::Mutex;
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use super::{Reward, RewardError, RewardInput, parse_score, shown};
use crate::process::LineProcess;

/// How long, after a batch's answers, a line the program was not asked for may take to be
/// caught with that batch (later, it is caught before the next batch is sent).
const STRAY_LINE_GRACE: Duration = Duration::from_millis(20);

/// `reward.command`: a persistent scoring process.
pub struct CommandReward {
    name: String,
    argv: Vec<String>,
    /// How long a batch may take to be answered.
    timeout: Duration,
    /// How many times a failed batch is retried in a fresh process before the error stands.
    retries: usize,
    process: Mutex<Option<LineProcess>>,
}

/// The next line of `process`'s stdout within `wait` (`None` when none came).
fn next_line(process: &mut LineProcess, wait: Duration) -> Result<Option<String>, String> {
    process.recv(wait).or(Ok(None))
}

/// The error for a line nobody asked for.
fn stray(process: &LineProcess, line: &str) -> String {
    format!(
        "printed a line it was not asked for (line {} of its output: {}); each request is \
         answered by exactly one line, and an extra one would shift every later score",
        process.lines_read,
        shown(line, 200)
    )
}

impl CommandReward {
    /// The process starts at the first batch (so ranks that never score start none).
    pub fn new(name: impl Into<String>, argv: Vec<String>, timeout: Duration, retries: usize) -> Self {
        Self {
            name: name.into(),
            argv,
            timeout,
            retries,
            process: Mutex::new(None),
        }
    }

    fn command_line(&self) -> String {
        self.argv.join(" ")
    }

    fn spawn(&self) -> Result<LineProcess, String> {
        LineProcess::spawn(&self.argv, "reward.command")
    }

    /// One attempt at a batch in `process`; the error says what went wrong.
    fn attempt(&self, process: &mut LineProcess, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, String> {
        if let Some(line) = next_line(process, Duration::ZERO)? {
            return Err(stray(process, &line));
        }
        let mut payload = String::new();
        for input in batch {
            payload.push_str(&input.to_json().to_string());
            payload.push('\n');
        }
        process.send(&payload)?;
        let deadline = Instant::now() + self.timeout;
        let mut scores = Vec::with_capacity(batch.len());
        for i in 0..batch.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match process.recv(left) {
                Ok(Some(line)) => line,
                Ok(None) | Err(RecvTimeoutError::Timeout) => {
                    return Err(format!(
                        "answered {i} of {} requests within {:.1} s (reward.timeout_seconds)",
                        batch.len(),
                        self.timeout.as_secs_f64()
                    ));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!(
                        "closed its stdout after answering {i} of {} requests",
                        batch.len()
                    ));
                }
            };
            let score = serde_json::from_str(line.trim())
                .ok()
                .and_then(|v| parse_score(&v))
                .ok_or_else(|| {
                    format!(
                        "answer {i} of the batch (line {} of its output) is {}, not a finite \
                         number or {{\"score\": number}}",
                        process.lines_read,
                        shown(&line, 200)
                    )
                })?;
            scores.push(score);
        }
        if let Some(line) = next_line(process, STRAY_LINE_GRACE)? {
            return Err(stray(process, &line));
        }
        Ok(scores)
    }
}

impl Reward for CommandReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, batch: &[RewardInput<'_>]) -> Result<Vec<f64>, RewardError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let fail = |m: String| RewardError::new(&self.name, format!("`{}` {m}", self.command_line()));
        let mut slot = self
            .process
            .lock()
            .map_err(|_| fail("is unusable: an earlier call panicked".into()))?;
        let mut last = String::new();
        for attempt in 0..=self.retries {
            if slot.is_none() {
                *slot = Some(self.spawn().map_err(fail)?);
            }
            let Some(process) = slot.as_mut() else { continue };
            match self.attempt(process, batch) {
                Ok(scores) => return Ok(scores),
                Err(why) => {
                    // A process that failed once is not trusted with the next batch: its
                    // answers could be out of step with the requests.
                    let ended = slot.take().map(LineProcess::end).unwrap_or_default();
                    last = format!("{why} (process: {ended})");
                    if attempt < self.retries {
                        tracing::warn!(reward = %self.name, attempt = attempt + 1, "{last}; retrying in a new process");
                    }
                }
            }
        }
        Err(fail(format!(
            "failed{}: {last}",
            if self.retries > 0 {
                format!(" {} times", self.retries + 1)
            } else {
                String::new()
            }
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::tests::inputs;
    use serde_json::Map;

    fn python(script: &str, timeout: f64, retries: usize) -> CommandReward {
        CommandReward::new(
            "test",
            vec!["python3".into(), "-u".into(), "-c".into(), script.into()],
            Duration::from_secs_f64(timeout),
            retries,
        )
    }

    const LENGTH: &str = r#"
import json, sys
for line in sys.stdin:
    req = json.loads(line)
    print(json.dumps({"score": len(req["response"]) + req["metadata"].get("bonus", 0)}))
"#;

    #[test]
    fn a_persistent_process_scores_batch_after_batch() {
        let reward = python(LENGTH, 30.0, 0);
        let mut fields = Map::new();
        fields.insert("bonus".into(), 10.into());
        assert_eq!(
            reward.score(&inputs(&["ab", "abcd"], &fields)).unwrap(),
            vec![12.0, 14.0]
        );
        let pid = reward.process.lock().unwrap().as_ref().unwrap().id();
        assert_eq!(reward.score(&inputs(&["a"], &fields)).unwrap(), vec![11.0]);
        // The same process answered both batches.
        assert_eq!(reward.process.lock().unwrap().as_ref().unwrap().id(), pid);
    }

    #[test]
    fn a_crash_is_an_error_with_its_stderr() {
        let script =
            "import sys\nsys.stdin.readline()\nprint('boom: no verifier', file=sys.stderr)\nsys.exit(3)";
        let e = python(script, 30.0, 0)
            .score(&inputs(&["x", "y"], &Map::new()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"test\"") && e.contains("python3"), "{e}");
        assert!(
            e.contains("answering 0 of 2") && e.contains("boom: no verifier"),
            "{e}"
        );
    }

    #[test]
    fn a_hang_is_an_error_after_the_timeout() {
        let script = "import time, sys\nsys.stdin.readline()\ntime.sleep(60)";
        let started = Instant::now();
        let e = python(script, 0.5, 0)
            .score(&inputs(&["x"], &Map::new()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("answered 0 of 1 requests within 0.5 s"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(20));
    }

    #[test]
    fn garbage_is_an_error_quoting_it() {
        let script = "import sys\nfor line in sys.stdin:\n    print('looks good to me')";
        let e = python(script, 30.0, 0)
            .score(&inputs(&["x"], &Map::new()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"looks good to me\"") && e.contains("not a finite number"),
            "{e}"
        );
        let nan = "import sys\nfor line in sys.stdin:\n    print('NaN')";
        assert!(python(nan, 30.0, 0).score(&inputs(&["x"], &Map::new())).is_err());
    }

    #[test]
    fn a_line_nobody_asked_for_is_an_error_naming_it() {
        // Two answers per request: the second would be read as the next request's score.
        let twice = "import sys\nfor line in sys.stdin:\n    print(1)\n    print(2)";
        let reward = python(twice, 30.0, 0);
        let first = reward.score(&inputs(&["x", "y"], &Map::new()));
        std::thread::sleep(Duration::from_millis(200));
        let second = reward.score(&inputs(&["z"], &Map::new()));
        let e = first
            .err()
            .or(second.err())
            .expect("a stray line was read as a score")
            .to_string();
        assert!(
            e.contains("python3") && e.contains("not asked for") && e.contains("line 3 of its output: \"1\""),
            "{e}"
        );
        // A banner before the answers is named by its line.
        let banner = "import sys\nprint('verifier ready')\nfor line in sys.stdin:\n    print(1)";
        let e = python(banner, 30.0, 0)
            .score(&inputs(&["x"], &Map::new()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 1 of its output") && e.contains("verifier ready"),
            "{e}"
        );
        // A well-behaved program answering batch after batch is never blamed.
        let reward = python(LENGTH, 30.0, 0);
        for _ in 0..5 {
            assert_eq!(
                reward.score(&inputs(&["ab", "c"], &Map::new())).unwrap(),
                vec![2.0, 1.0]
            );
        }
    }

    #[test]
    fn retries_start_a_fresh_process() {
        // The first process crashes (it leaves a marker file); the second one scores.
        let marker = std::env::temp_dir().join(format!("aligner-reward-retry-{}", std::process::id()));
        let _ = std::fs::remove_file(&marker);
        let script = format!(
            "import os, sys\nm = {:?}\nif not os.path.exists(m):\n    open(m, 'w').close()\n    sys.exit(1)\nfor line in sys.stdin:\n    print(7)",
            marker.display().to_string()
        );
        assert_eq!(
            python(&script, 30.0, 1)
                .score(&inputs(&["x"], &Map::new()))
                .unwrap(),
            vec![7.0]
        );
        let _ = std::fs::remove_file(&marker);
        let e = python("import sys\nsys.exit(1)", 30.0, 2)
            .score(&inputs(&["x"], &Map::new()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("failed 3 times"), "{e}");
    }

    #[test]
    fn a_missing_program_is_named() {
        let reward = CommandReward::new("v", vec!["./no-such-verifier".into()], Duration::from_secs(1), 0);
        let e = reward
            .score(&inputs(&["x"], &Map::new()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot start `./no-such-verifier`"), "{e}");
    }
}
