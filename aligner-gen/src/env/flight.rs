//! Episodes in flight: each episode's next turn starts as soon as the environment has answered
//! its last one, while the others go on decoding.
//!
//! [`run_episodes`](super::run_episodes) advances a batch turn by turn: every episode's turn is
//! decoded, then the environment answers them all, then the next turns start together, so the
//! engine idles while the environment works and every episode waits for the slowest. Here the
//! engine serves a [`RequestFeed`] that never runs dry while an episode is going: a finished
//! turn goes to the environment at once (the turns that finish together make one batch, and
//! batches are answered side by side, each on a thread of its own), and the answered episode's
//! next turn joins the running rows at the next decode step. Each turn samples from the same
//! random stream as in lock step, so the episodes are the same tokens either way.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};

use aligner_core::TextTokenizer;

use super::{
    Environment, Episode, EpisodeLimits, EpisodeStart, Turn, TurnResult, take_reply, take_turn, turn_request,
};
use crate::engine::{FeedBounds, RequestFeed};
use crate::{GenError, Generation, GenerationRequest, Result};

/// Runs every episode of `starts` in `env`, keeping each going independently of the others:
/// `serve` runs an engine (or a pool of them) on the feed it is given until the feed is done,
/// handing each finished turn to the callback it is given. `first_id` numbers the episodes
/// (`first_id + i`). The episodes are those [`run_episodes`](super::run_episodes) makes.
pub fn run_episodes_continuous(
    starts: &[EpisodeStart<'_>],
    first_id: u64,
    limits: &EpisodeLimits,
    tokenizer: &TextTokenizer,
    serve: &mut dyn FnMut(&dyn RequestFeed, &TurnDone<'_>) -> Result<()>,
    env: &dyn Environment,
) -> Result<Vec<Episode>> {
    let flight = Flight::new(starts, limits, tokenizer);
    std::thread::scope(|scope| {
        let answering = scope.spawn(|| flight.answer(scope, env, first_id));
        let served = serve(&flight, &|i, out| flight.turn_done(i, out));
        // Whatever happened, nothing more is asked of the environment.
        flight.close();
        if answering.join().is_err() {
            flight.fail("the thread handing turns to the environment panicked");
        }
        served
    })?;
    flight.finish()
}

/// The error of a run stopped for `why`.
fn failed(why: String) -> GenError {
    GenError::Core(aligner_core::CoreError::Invalid(why))
}

/// Takes a decoded turn: the key the feed gave it, and the engine's output.
pub type TurnDone<'a> = dyn Fn(usize, Generation) -> Result<()> + Sync + 'a;

/// The episodes and what is waiting on whom.
struct Flight<'s, 'a> {
    starts: &'s [EpisodeStart<'a>],
    limits: &'s EpisodeLimits,
    tokenizer: &'s TextTokenizer,
    state: Mutex<State>,
    /// Signalled whenever `state` changes.
    changed: Condvar,
}

struct State {
    episodes: Vec<Episode>,
    /// Episodes whose next turn may start.
    ready: VecDeque<usize>,
    /// Turns decoded and not yet handed to the environment: the episode and the turn's text.
    to_answer: Vec<(usize, String)>,
    /// Episodes that are over.
    over: usize,
    /// Why the run stopped (a turn's text would not decode, an observation not encode).
    failure: Option<String>,
    /// Nothing more is served or answered.
    closed: bool,
}

impl<'s, 'a> Flight<'s, 'a> {
    fn new(starts: &'s [EpisodeStart<'a>], limits: &'s EpisodeLimits, tokenizer: &'s TextTokenizer) -> Self {
        // An episode without a token to spend is over before its first turn, as in lock step.
        let ready: VecDeque<usize> = (0..starts.len()).filter(|_| limits.max_tokens > 0).collect();
        Self {
            starts,
            limits,
            tokenizer,
            state: Mutex::new(State {
                episodes: starts.iter().map(|_| Episode::empty()).collect(),
                over: starts.len() - ready.len(),
                ready,
                to_answer: Vec::new(),
                failure: None,
                closed: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn all_over(&self, state: &State) -> bool {
        state.over == self.starts.len()
    }

    /// Stops the run with `why` (the first reason given stays).
    fn fail(&self, why: impl Into<String>) {
        let mut state = self.lock();
        state.failure.get_or_insert(why.into());
        state.closed = true;
        self.changed.notify_all();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    /// A decoded turn of episode `i`: appended, and queued for the environment.
    fn turn_done(&self, i: usize, out: Generation) -> Result<()> {
        let mut state = self.lock();
        let text = take_turn(&self.starts[i], &mut state.episodes[i], out, self.tokenizer);
        match text {
            Ok(text) => {
                state.to_answer.push((i, text));
                self.changed.notify_all();
                Ok(())
            }
            Err(e) => {
                drop(state);
                self.fail(e.to_string());
                Err(e)
            }
        }
    }

    /// Hands the decoded turns to `env` as they come, each batch on a thread of its own, until
    /// every episode is over or the run is closed.
    fn answer<'scope>(
        &'scope self,
        scope: &'scope std::thread::Scope<'scope, '_>,
        env: &'scope dyn Environment,
        first_id: u64,
    ) {
        loop {
            let batch = {
                let mut state = self.lock();
                while state.to_answer.is_empty() && !state.closed && !self.all_over(&state) {
                    state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                if state.closed || self.all_over(&state) {
                    return;
                }
                let batch = std::mem::take(&mut state.to_answer);
                // The turn each episode just took.
                batch
                    .into_iter()
                    .map(|(i, text)| (i, state.episodes[i].turns - 1, text))
                    .collect::<Vec<_>>()
            };
            scope.spawn(move || {
                let turns: Vec<Turn<'_>> = batch
                    .iter()
                    .map(|(i, turn, text)| self.starts[*i].turn(first_id, *i, *turn, text))
                    .collect();
                let replies = env.step(&turns);
                if replies.len() != turns.len() {
                    return self.fail(format!(
                        "environment `{}` answered {} of {} turns",
                        env.name(),
                        replies.len(),
                        turns.len()
                    ));
                }
                self.take_replies(batch.iter().map(|(i, _, _)| *i).zip(replies));
            });
        }
    }

    /// The environment's answers: each episode goes on (queued to start its next turn) or
    /// is over.
    fn take_replies(&self, replies: impl Iterator<Item = (usize, TurnResult)>) {
        let mut state = self.lock();
        for (i, reply) in replies {
            match take_reply(&mut state.episodes[i], reply, self.limits, self.tokenizer) {
                Ok(true) => state.ready.push_back(i),
                Ok(false) => state.over += 1,
                Err(e) => {
                    drop(state);
                    self.fail(e.to_string());
                    return;
                }
            }
        }
        self.changed.notify_all();
    }

    /// The episodes, once the run is over.
    fn finish(self) -> Result<Vec<Episode>> {
        let state = self.state.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = state.failure {
            return Err(failed(why));
        }
        Ok(state.episodes)
    }
}

impl RequestFeed for Flight<'_, '_> {
    fn bounds(&self) -> FeedBounds {
        // A turn's prompt is the episode's prompt and less than `max_tokens` of the episode,
        // and a turn samples at most what is left of `max_tokens` (`turn_request`): no
        // sequence goes past the longest prompt and `max_tokens`.
        let prompt_width =
            self.starts.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(0) + self.limits.max_tokens;
        FeedBounds {
            prompt_width,
            span: prompt_width,
            guided: false,
        }
    }

    fn next(&self, wait: bool) -> Result<Option<(usize, GenerationRequest)>> {
        let mut state = self.lock();
        loop {
            if let Some(why) = &state.failure {
                return Err(failed(why.clone()));
            }
            if state.closed {
                return Ok(None);
            }
            if let Some(i) = state.ready.pop_front() {
                let request = turn_request(&self.starts[i], &state.episodes[i], self.limits);
                return Ok(Some((i, request)));
            }
            if !wait || self.all_over(&state) {
                return Ok(None);
            }
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn close(&self) {
        Flight::close(self);
    }
}
