//! A program that stays running and talks in lines: what a command reward and a command
//! environment both are. Its stdout is read on a thread of its own (so neither side blocks)
//! into a channel, the last lines of its stderr are kept for error messages, and dropping it
//! closes its stdin and waits a moment for it to exit before killing it.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Starts `program args` with stdin, stdout and stderr piped to this process.
pub(crate) fn spawn_piped(program: &str, args: &[String]) -> std::io::Result<Child> {
    Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
}

/// Lines of the program's stderr kept for an error message.
const STDERR_LINES: usize = 20;

/// A running line-speaking program.
pub(crate) struct LineProcess {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    lines: Receiver<std::io::Result<String>>,
    /// Lines read from its stdout so far (an error names a line by its number).
    pub lines_read: usize,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl LineProcess {
    /// Starts `argv`; `what` names the setting it came from in errors (`reward.command`).
    pub fn spawn(argv: &[String], what: &str) -> Result<Self, String> {
        let (program, args) = argv.split_first().ok_or_else(|| format!("{what} is empty"))?;
        let mut child =
            spawn_piped(program, args).map_err(|e| format!("cannot start `{}`: {e}", argv.join(" ")))?;
        let (stdin, stdout, stderr) = match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
            (Some(i), Some(o), Some(e)) => (i, o, e),
            _ => return Err("the process's pipes could not be opened".into()),
        };
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let kept = Arc::new(Mutex::new(VecDeque::new()));
        let tail = kept.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(mut tail) = tail.lock() {
                    if tail.len() == STDERR_LINES {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            }
        });
        Ok(Self {
            child: Some(child),
            stdin: Some(stdin),
            lines,
            lines_read: 0,
            stderr: kept,
        })
    }

    /// Its process id (`None` once it has ended): tests check which process answered.
    #[cfg(test)]
    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Writes `payload` to its stdin and flushes.
    pub fn send(&mut self, payload: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("its stdin is closed")?;
        stdin
            .write_all(payload.as_bytes())
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("could not write to it (the process exited?): {e}"))
    }

    /// The next line of its stdout within `wait`: `Ok(None)` when none came in time, `Err`
    /// with `Disconnected` when its stdout is closed.
    pub fn recv(&mut self, wait: Duration) -> Result<Option<String>, RecvTimeoutError> {
        match self.lines.recv_timeout(wait) {
            Ok(Ok(line)) => {
                self.lines_read += 1;
                Ok(Some(line))
            }
            Ok(Err(_)) => Err(RecvTimeoutError::Disconnected),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// "; its stderr ends: ..." when it wrote any.
    pub fn stderr_tail(&self) -> String {
        match self.stderr.lock().map(|l| l.iter().cloned().collect::<Vec<_>>()) {
            Ok(lines) if !lines.is_empty() => format!("; its stderr ends:\n  {}", lines.join("\n  ")),
            _ => String::new(),
        }
    }

    /// Kills the process (if still running) and says how it ended.
    pub fn end(mut self) -> String {
        let status = match self.child.take() {
            Some(mut child) => match child.try_wait() {
                Ok(Some(status)) => status.to_string(),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    "still running; killed".to_string()
                }
            },
            None => "gone".to_string(),
        };
        // The stderr reader may still be taking the last lines.
        std::thread::sleep(Duration::from_millis(50));
        format!("{status}{}", self.stderr_tail())
    }
}

impl Drop for LineProcess {
    /// A well-behaved program exits when its stdin closes; one that does not is killed.
    fn drop(&mut self) {
        drop(self.stdin.take());
        if let Some(mut child) = self.child.take() {
            let waited = Instant::now();
            while waited.elapsed() < Duration::from_millis(500) {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
