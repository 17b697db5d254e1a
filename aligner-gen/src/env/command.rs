//! An environment that is a program running for the whole run, speaking JSON Lines.
//!
//! Protocol: each turn is one line on the program's stdin, `{"episode", "turn", "prompt",
//! "response", "metadata"}` (every turn of a batch is written before any reply is read, so
//! many episodes are in flight at once); the program answers each with one line on its
//! stdout, `{"episode": id, "observation": text, "reward": number, "done": bool}` (all but
//! `episode` optional) or `{"episode": id, "error": "why"}`, in any order: replies are
//! matched by episode id. A line that is not JSON or names no episode waiting for an answer
//! is counted and quoted in the error of the episodes left unanswered; a reply that names its
//! episode but is malformed ends that episode. A crash ends every episode it leaves
//! unanswered (with the end of its stderr) and the next batch starts a fresh process; so does
//! a hang, after `timeout`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{Environment, Turn, TurnError, TurnResult, parse_reply, turn_json};
use crate::process::LineProcess;
use crate::reward::shown;

/// `environment.command`: a persistent environment process.
pub struct CommandEnvironment {
    name: String,
    argv: Vec<String>,
    /// How long a batch of turns may take to be answered.
    timeout: Duration,
    process: Mutex<Option<LineProcess>>,
}

impl CommandEnvironment {
    /// The process starts at the first batch.
    pub fn new(name: impl Into<String>, argv: Vec<String>, timeout: Duration) -> Self {
        Self {
            name: name.into(),
            argv,
            timeout,
            process: Mutex::new(None),
        }
    }

    fn command_line(&self) -> String {
        self.argv.join(" ")
    }

    /// Writes `turns` and collects the replies; `Err` when the process cannot go on (it is
    /// then replaced), with what was answered before it stopped.
    fn exchange(
        &self,
        process: &mut LineProcess,
        turns: &[Turn<'_>],
        out: &mut [Option<TurnResult>],
    ) -> Result<(), String> {
        let mut payload = String::new();
        for turn in turns {
            payload.push_str(&turn_json(turn).to_string());
            payload.push('\n');
        }
        process.send(&payload)?;
        let waiting: HashMap<u64, usize> = turns.iter().enumerate().map(|(i, t)| (t.episode, i)).collect();
        let mut unanswered = turns.len();
        let mut garbage: Vec<String> = Vec::new();
        let deadline = Instant::now() + self.timeout;
        while unanswered > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match process.recv(left) {
                Ok(Some(line)) => line,
                Ok(None) | Err(RecvTimeoutError::Timeout) => {
                    let mut why = format!(
                        "answered {} of {} turns within {:.1} s (environment.timeout_seconds)",
                        turns.len() - unanswered,
                        turns.len(),
                        self.timeout.as_secs_f64()
                    );
                    if !garbage.is_empty() {
                        why.push_str(&format!(
                            "; lines that answer no waiting episode: {}",
                            garbage.join(", ")
                        ));
                    }
                    return Err(why);
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!(
                        "closed its stdout after answering {} of {} turns",
                        turns.len() - unanswered,
                        turns.len()
                    ));
                }
            };
            let value: Option<Value> = serde_json::from_str(line.trim()).ok();
            let slot = value
                .as_ref()
                .and_then(|v| v.get("episode"))
                .and_then(Value::as_u64)
                .and_then(|id| waiting.get(&id).copied())
                .filter(|&i| out[i].is_none());
            match (slot, value) {
                (Some(i), Some(value)) => {
                    out[i] = Some(parse_reply(&value));
                    unanswered -= 1;
                }
                _ => {
                    if garbage.len() < 3 {
                        garbage.push(shown(&line, 120));
                    }
                }
            }
        }
        Ok(())
    }
}

impl Environment for CommandEnvironment {
    fn name(&self) -> &str {
        &self.name
    }

    fn step(&self, turns: &[Turn<'_>]) -> Vec<TurnResult> {
        if turns.is_empty() {
            return Vec::new();
        }
        let fail = |why: String| TurnError::env(format!("environment `{}`: {why}", self.command_line()));
        let Ok(mut slot) = self.process.lock() else {
            return turns
                .iter()
                .map(|_| Err(fail("is unusable: an earlier call panicked".into())))
                .collect();
        };
        if slot.is_none() {
            match LineProcess::spawn(&self.argv, "environment.command") {
                Ok(p) => *slot = Some(p),
                Err(why) => return turns.iter().map(|_| Err(fail(why.clone()))).collect(),
            }
        }
        let mut out: Vec<Option<TurnResult>> = vec![None; turns.len()];
        let stopped = match slot.as_mut() {
            Some(process) => self.exchange(process, turns, &mut out).err(),
            None => Some("did not start".into()),
        };
        if let Some(why) = stopped {
            // The process is not trusted with the next batch.
            let ended = slot.take().map(LineProcess::end).unwrap_or_default();
            tracing::warn!(environment = %self.name, "{why} (process: {ended}); the next turns start a new one");
            for o in out.iter_mut().filter(|o| o.is_none()) {
                *o = Some(Err(fail(format!("{why} (process: {ended})"))));
            }
        }
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| Err(fail("no reply".into()))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn python(script: &str, timeout: f64) -> CommandEnvironment {
        CommandEnvironment::new(
            "test",
            vec!["python3".into(), "-u".into(), "-c".into(), script.into()],
            Duration::from_secs_f64(timeout),
        )
    }

    fn turns<'a>(ids: &[u64], response: &'a str, metadata: &'a Map<String, Value>) -> Vec<Turn<'a>> {
        ids.iter()
            .map(|&episode| Turn {
                episode,
                turn: 0,
                prompt: "p",
                response,
                metadata,
            })
            .collect()
    }

    /// Answers in reverse order; episode 2 gets garbage first, episode 3 an error, episode 4
    /// crashes the process.
    const SCRIPT: &str = r#"
import json, sys
pending = []
for line in sys.stdin:
    t = json.loads(line)
    pending.append(t)
    if t["episode"] == 4:
        sys.stderr.write("boom on episode 4\n")
        sys.exit(3)
    if len(pending) < 3:
        continue
    for t in reversed(pending):
        e = t["episode"]
        if e == 2:
            print("garbage {")
        if e == 3:
            print(json.dumps({"episode": e, "error": "no such room"}))
        else:
            print(json.dumps({"episode": e, "observation": t["response"].upper(), "reward": e, "done": e == 1}))
    pending = []
"#;

    #[test]
    fn replies_are_matched_by_episode_and_failures_end_only_their_episode() {
        let env = python(SCRIPT, 5.0);
        let metadata = Map::new();
        let out = env.step(&turns(&[1, 2, 3], "go", &metadata));
        let first = out[0].clone().unwrap();
        assert_eq!(first.observation.as_deref(), Some("GO"));
        assert!(first.done);
        assert_eq!(out[1].clone().unwrap().reward, Some(2.0));
        assert!(out[2].clone().unwrap_err().reason.contains("no such room"));
        // The same process answers the next batch.
        let again = env.step(&turns(&[5, 6, 7], "x", &metadata));
        assert!(again.iter().all(Result::is_ok), "{again:?}");
        // A crash ends the batch's episodes with the stderr; a fresh process takes the next.
        let crashed = env.step(&turns(&[4, 8, 9], "x", &metadata));
        for r in &crashed {
            let why = r.clone().unwrap_err().reason;
            assert!(why.contains("boom on episode 4"), "{why}");
        }
        let fresh = env.step(&turns(&[10, 11, 12], "x", &metadata));
        assert!(fresh.iter().all(Result::is_ok), "{fresh:?}");
    }

    #[test]
    fn a_hang_or_garbage_alone_fails_after_the_timeout_quoting_the_line() {
        let env = python("import sys\nfor line in sys.stdin:\n    print('not json')\n", 0.5);
        let metadata = Map::new();
        let out = env.step(&turns(&[1], "x", &metadata));
        let why = out[0].clone().unwrap_err().reason;
        assert!(why.contains("within 0.5 s") && why.contains("not json"), "{why}");
        let missing = CommandEnvironment::new("x", vec!["/no/such/program".into()], Duration::from_secs(1));
        let why = missing.step(&turns(&[1], "x", &metadata))[0]
            .clone()
            .unwrap_err()
            .reason;
        assert!(why.contains("cannot start `/no/such/program`"), "{why}");
    }
}
