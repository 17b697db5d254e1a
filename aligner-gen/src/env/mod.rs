//! Multi-turn episodes: the model acts, an [`Environment`] answers, the model goes on.
//!
//! An episode starts from a prompt row. Each turn the model's answer (sampled by whatever
//! `generate` the caller hands in: an engine, a worker pool, the data-parallel ranks') is given
//! to the environment, which replies with an observation, an optional reward for the turn and
//! whether the episode is over. The observation's text is tokenized once and appended to the
//! episode's tokens: the episode is one growing token sequence, so the tokens the model
//! produced are exactly the tokens trained on and earlier turns are never re-tokenized. Each
//! next turn is sampled from the whole sequence so far.
//!
//! Environments: [`CommandEnvironment`] (a persistent subprocess speaking JSON Lines, one
//! episode id per line, many episodes in flight), [`HttpEnvironment`] (a JSON endpoint) and
//! [`ToolEnvironment`] (the model's turn is parsed for a tool call, the tool, a subprocess or
//! an endpoint, runs with a timeout and its output is the observation). A crash, a hang, a
//! garbage reply or an unknown tool ends that episode with its reason ([`Episode::error`]),
//! never the run.

mod command;
mod flight;
mod http;
mod tools;

use aligner_core::TextTokenizer;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Generation, GenerationRequest, Result, SamplingParams, StopReason};

pub use command::CommandEnvironment;
pub use flight::{TurnDone, run_episodes_continuous};
pub use http::HttpEnvironment;
pub use tools::{ToolCallFormat, ToolEnvironment, ToolSpec, parse_tool_call, tools_json};

/// One model turn handed to an environment.
#[derive(Debug, Clone, Serialize)]
pub struct Turn<'a> {
    /// The episode's id: unique within a run, the same on every turn of one episode.
    pub episode: u64,
    /// 0 for the model's first answer to the prompt.
    pub turn: usize,
    /// The prompt as the model saw it.
    pub prompt: &'a str,
    /// The model's answer this turn (its tokens decoded, EOS left out).
    pub response: &'a str,
    /// The prompt row's other fields.
    pub metadata: &'a Map<String, Value>,
}

/// An environment's answer to one turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// Text appended to the episode after the model's turn (none: nothing to add).
    #[serde(default)]
    pub observation: Option<String>,
    /// This turn's reward (added to the episode's).
    #[serde(default)]
    pub reward: Option<f64>,
    /// The episode is over.
    #[serde(default)]
    pub done: bool,
    /// Tool calls made this turn (a tool environment counts them).
    #[serde(default)]
    pub tool_calls: usize,
}

/// What ended an episode early: the reason, and whether a tool (rather than the environment
/// itself) failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnError {
    pub reason: String,
    pub tool: bool,
}

impl TurnError {
    pub fn env(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            tool: false,
        }
    }

    pub fn tool(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            tool: true,
        }
    }
}

/// The outcome of one turn: the reply, or why the episode ends here.
pub type TurnResult = std::result::Result<Reply, TurnError>;

/// An environment the model acts in.
pub trait Environment: Send + Sync {
    /// Its name in metrics and errors.
    fn name(&self) -> &str;

    /// Answers `turns` (of different episodes), in order. An `Err` ends only its episode.
    fn step(&self, turns: &[Turn<'_>]) -> Vec<TurnResult>;
}

/// How far an episode may run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpisodeLimits {
    /// Model turns at most.
    pub max_turns: usize,
    /// Tokens after the prompt (the model's and the observations') at most.
    pub max_tokens: usize,
    /// New tokens per model turn at most.
    pub turn_max_new_tokens: usize,
}

/// Where an episode starts: the prompt row and how its turns are sampled (`params.seed` is
/// the first turn's; later turns draw their own).
#[derive(Debug, Clone)]
pub struct EpisodeStart<'a> {
    pub prompt_ids: &'a [u32],
    pub prompt: &'a str,
    pub metadata: &'a Map<String, Value>,
    pub params: SamplingParams,
}

/// A finished episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Episode {
    /// Everything after the prompt, the model's tokens and the observations' interleaved;
    /// `token_logprobs` is 0 on observation tokens; `stop_reason` the last model turn's.
    pub generation: Generation,
    /// `true` on observation tokens (not the model's: masked from every loss).
    pub observed: Vec<bool>,
    /// Model turns taken.
    pub turns: usize,
    /// Each turn's reward (0 where the environment gave none).
    pub turn_rewards: Vec<f64>,
    pub tool_calls: usize,
    /// Why the episode ended early, when a turn failed.
    pub error: Option<TurnError>,
}

impl Episode {
    /// The sum of the turns' rewards.
    pub fn reward(&self) -> f64 {
        self.turn_rewards.iter().sum()
    }

    /// Observation tokens in the episode.
    pub fn observation_tokens(&self) -> usize {
        self.observed.iter().filter(|&&o| o).count()
    }

    /// The model's own tokens (`!observed`), the model turns' text joined.
    pub fn model_token_ids(&self) -> Vec<u32> {
        self.generation
            .token_ids
            .iter()
            .zip(&self.observed)
            .filter(|(_, o)| !**o)
            .map(|(t, _)| *t)
            .collect()
    }
}

/// Episodes run in lock step: every episode still going samples its next turn in one batch
/// (`generate`, in request order), then `step` answers every turn (the caller decides where
/// the environment runs: data-parallel ranks share rank 0's replies). `first_id` numbers the
/// episodes (`first_id + i`). [`run_episodes_continuous`] runs the same episodes without the
/// lock step, to the same tokens.
pub fn run_episodes(
    starts: &[EpisodeStart<'_>],
    first_id: u64,
    limits: &EpisodeLimits,
    tokenizer: &TextTokenizer,
    generate: &mut dyn FnMut(&[GenerationRequest]) -> Result<Vec<Generation>>,
    step: &mut dyn FnMut(&[Turn<'_>]) -> Result<Vec<TurnResult>>,
) -> Result<Vec<Episode>> {
    let mut episodes: Vec<Episode> = starts.iter().map(|_| Episode::empty()).collect();
    let mut going: Vec<usize> = (0..starts.len()).filter(|_| limits.max_tokens > 0).collect();
    while !going.is_empty() {
        let requests: Vec<GenerationRequest> = going
            .iter()
            .map(|&i| turn_request(&starts[i], &episodes[i], limits))
            .collect();
        let outputs = generate(&requests)?;
        let mut texts = Vec::with_capacity(going.len());
        for (&i, out) in going.iter().zip(outputs) {
            texts.push(take_turn(&starts[i], &mut episodes[i], out, tokenizer)?);
        }
        let turns: Vec<Turn<'_>> = going
            .iter()
            .zip(&texts)
            .map(|(&i, text)| starts[i].turn(first_id, i, episodes[i].turns - 1, text))
            .collect();
        let replies = step(&turns)?;
        let mut next = Vec::with_capacity(going.len());
        for (&i, reply) in going.iter().zip(replies) {
            if take_reply(&mut episodes[i], reply, limits, tokenizer)? {
                next.push(i);
            }
        }
        going = next;
    }
    Ok(episodes)
}

impl Episode {
    /// An episode before its first turn.
    fn empty() -> Self {
        Self {
            generation: Generation {
                token_ids: Vec::new(),
                token_logprobs: Vec::new(),
                stop_reason: StopReason::MaxTokens,
            },
            observed: Vec::new(),
            turns: 0,
            turn_rewards: Vec::new(),
            tool_calls: 0,
            error: None,
        }
    }
}

impl<'a> EpisodeStart<'a> {
    /// Episode `i`'s turn `turn` as the environment sees it.
    fn turn(&self, first_id: u64, i: usize, turn: usize, response: &'a str) -> Turn<'a> {
        Turn {
            episode: first_id.wrapping_add(i as u64),
            turn,
            prompt: self.prompt,
            response,
            metadata: self.metadata,
        }
    }
}

/// The request of `episode`'s next model turn: the prompt and the episode so far.
fn turn_request(start: &EpisodeStart<'_>, episode: &Episode, limits: &EpisodeLimits) -> GenerationRequest {
    let turn = episode.turns;
    let left = limits.max_tokens - episode.generation.token_ids.len();
    let mut prompt_ids = start.prompt_ids.to_vec();
    prompt_ids.extend(&episode.generation.token_ids);
    GenerationRequest::new(
        prompt_ids,
        SamplingParams {
            max_new_tokens: limits.turn_max_new_tokens.min(left),
            // Each turn its own random stream.
            seed: start
                .params
                .seed
                .wrapping_add((turn as u64).wrapping_mul(0x9e37_79b9)),
            // The next turn continues this sequence: its cache is kept, and only the
            // observation is computed then.
            keep_cache: turn + 1 < limits.max_turns,
            ..start.params.clone()
        },
    )
}

/// Appends a model turn to `episode`; returns its text, as the environment reads it.
fn take_turn(
    start: &EpisodeStart<'_>,
    episode: &mut Episode,
    out: Generation,
    tokenizer: &TextTokenizer,
) -> Result<String> {
    let context: Vec<u32> = start
        .prompt_ids
        .iter()
        .chain(&episode.generation.token_ids)
        .copied()
        .collect();
    let text = tokenizer.decode_continuation(&context, &out.token_ids)?;
    episode.generation.token_ids.extend(&out.token_ids);
    episode.generation.token_logprobs.extend(&out.token_logprobs);
    episode.observed.resize(episode.generation.token_ids.len(), false);
    episode.generation.stop_reason = out.stop_reason;
    episode.turns += 1;
    Ok(text)
}

/// Appends the environment's answer to `episode`'s last turn; returns whether the episode
/// takes another turn (not done, not failed, its context, turns and tokens not spent).
fn take_reply(
    episode: &mut Episode,
    reply: TurnResult,
    limits: &EpisodeLimits,
    tokenizer: &TextTokenizer,
) -> Result<bool> {
    let reply = match reply {
        Err(error) => {
            episode.turn_rewards.push(0.0);
            if error.tool {
                episode.tool_calls += 1;
            }
            episode.error = Some(error);
            return Ok(false);
        }
        Ok(reply) => reply,
    };
    episode.turn_rewards.push(reply.reward.unwrap_or(0.0));
    episode.tool_calls += reply.tool_calls;
    let observation = match reply.observation.as_deref() {
        Some(text) if !text.is_empty() => tokenizer.encode(text, false)?,
        _ => Vec::new(),
    };
    let room = limits
        .max_tokens
        .saturating_sub(episode.generation.token_ids.len());
    let observation = &observation[..observation.len().min(room)];
    episode.generation.token_ids.extend(observation);
    episode
        .generation
        .token_logprobs
        .extend(std::iter::repeat_n(0.0, observation.len()));
    episode.observed.resize(episode.generation.token_ids.len(), true);
    Ok(!reply.done
        && episode.generation.stop_reason != StopReason::ContextFull
        && episode.turns < limits.max_turns.max(1)
        && episode.generation.token_ids.len() < limits.max_tokens)
}

/// What a batch of episodes did, for a step's metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EpisodeStats {
    pub turns: f64,
    pub tool_calls: f64,
    pub tool_errors: f64,
    /// Episodes ended by a failing environment (not a tool).
    pub env_errors: f64,
    pub observation_tokens: f64,
    /// The environment's reward per model turn.
    pub reward_per_turn: f64,
    /// The first error's reason, if any.
    pub first_error: Option<String>,
}

impl EpisodeStats {
    /// Means per episode (totals for the errors).
    pub fn of(episodes: &[Episode]) -> Self {
        let n = episodes.len().max(1) as f64;
        let turns: usize = episodes.iter().map(|e| e.turns).sum();
        Self {
            turns: turns as f64 / n,
            tool_calls: episodes.iter().map(|e| e.tool_calls).sum::<usize>() as f64 / n,
            tool_errors: episodes
                .iter()
                .filter(|e| e.error.as_ref().is_some_and(|e| e.tool))
                .count() as f64,
            env_errors: episodes
                .iter()
                .filter(|e| e.error.as_ref().is_some_and(|e| !e.tool))
                .count() as f64,
            observation_tokens: episodes.iter().map(Episode::observation_tokens).sum::<usize>() as f64 / n,
            reward_per_turn: episodes.iter().map(Episode::reward).sum::<f64>() / turns.max(1) as f64,
            first_error: episodes
                .iter()
                .find_map(|e| e.error.as_ref().map(|e| e.reason.clone())),
        }
    }

    /// The metrics a training step logs (`env/turns`, `env/tool_calls`, `env/tool_errors`,
    /// `env/errors`, `env/observation_tokens`, `env/reward_per_turn`); warns with the first
    /// failure's reason when episodes failed.
    pub fn metrics(&self) -> serde_json::Map<String, Value> {
        if let Some(why) = &self.first_error {
            tracing::warn!(
                errors = self.env_errors + self.tool_errors,
                "episodes ended by a failure (their reward as configured by environment.error_penalty); the first: {why}"
            );
        }
        [
            ("env/turns", self.turns),
            ("env/tool_calls", self.tool_calls),
            ("env/tool_errors", self.tool_errors),
            ("env/errors", self.env_errors),
            ("env/observation_tokens", self.observation_tokens),
            ("env/reward_per_turn", self.reward_per_turn),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_string(), value.into()))
        .collect()
    }
}

/// `[environment]`: where the model acts over several turns. Off unless `command`, `url` or
/// `tools` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvironmentSection {
    /// A persistent program speaking JSON Lines ([`CommandEnvironment`]).
    pub command: Vec<String>,
    /// Or an endpoint taking a batch of turns per POST ([`HttpEnvironment`]).
    pub url: Option<String>,
    /// Or tools the model calls ([`ToolEnvironment`]); the episode ends at a turn without a
    /// call.
    pub tools: Vec<ToolSpec>,
    /// How a tool call is written: empty = Hermes / Qwen `<tool_call>{json}</tool_call>`, or a
    /// regex with the named groups `name` and `arguments`.
    pub tool_call_regex: String,
    /// The observation after a tool call; `{name}` and `{result}` are replaced.
    pub observation_template: String,
    /// Model turns per episode at most.
    pub max_turns: usize,
    /// Tokens after the prompt (the model's and the observations') per episode at most.
    pub max_tokens: usize,
    /// New tokens per model turn at most (0 = the method's `max_new_tokens`).
    pub turn_max_new_tokens: usize,
    /// Strings that end a model turn (the engine's stop strings), e.g. `</tool_call>`.
    pub stop_strings: Vec<String>,
    /// How long the environment may take to answer a batch of turns.
    pub timeout_seconds: f64,
    /// Added to the reward of an episode a failing environment or tool ended (0: it keeps
    /// the reward it had).
    pub error_penalty: f64,
}

impl Default for EnvironmentSection {
    fn default() -> Self {
        Self {
            command: Vec::new(),
            url: None,
            tools: Vec::new(),
            tool_call_regex: String::new(),
            observation_template: "<tool_response>\n{result}\n</tool_response>\n".into(),
            max_turns: 4,
            max_tokens: 256,
            turn_max_new_tokens: 0,
            stop_strings: Vec::new(),
            timeout_seconds: 60.0,
            error_penalty: 0.0,
        }
    }
}

impl EnvironmentSection {
    /// Whether episodes are multi-turn.
    pub fn enabled(&self) -> bool {
        !self.command.is_empty() || self.url.is_some() || !self.tools.is_empty()
    }

    /// What `episode` earns from the environment: its turns' rewards, plus `error_penalty`
    /// when a failure ended it.
    pub fn reward_of(&self, episode: &Episode) -> f64 {
        let penalty = if episode.error.is_some() {
            self.error_penalty
        } else {
            0.0
        };
        episode.reward() + penalty
    }

    /// The episodes of `requests`, request `i` started from the prompt row `owner(i)` (its
    /// text and fields go to the environment), each turn ending at the section's stop strings.
    pub fn starts<'a>(
        &self,
        requests: &'a [GenerationRequest],
        owner: impl Fn(usize) -> &'a aligner_core::data::EncodedPrompt,
    ) -> Vec<EpisodeStart<'a>> {
        requests
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let row = owner(i);
                EpisodeStart {
                    prompt_ids: &r.prompt_ids,
                    prompt: &row.text,
                    metadata: &row.fields,
                    params: SamplingParams {
                        stop_strings: self.stop_strings.clone(),
                        ..r.params.clone()
                    },
                }
            })
            .collect()
    }

    /// Runs `requests` as episodes in `env` on `engine` in this process ([`Self::starts`],
    /// [`run_episodes_continuous`] within the section's limits, `max_new_tokens` a turn unless
    /// `turn_max_new_tokens` says otherwise; episode ids from `first_id`).
    #[allow(clippy::too_many_arguments)]
    pub fn run<'a>(
        &self,
        env: &dyn Environment,
        engine: &mut crate::Engine,
        tokenizer: &TextTokenizer,
        requests: &'a [GenerationRequest],
        owner: impl Fn(usize) -> &'a aligner_core::data::EncodedPrompt,
        first_id: u64,
        max_new_tokens: usize,
    ) -> Result<Vec<Episode>> {
        run_episodes_continuous(
            &self.starts(requests, owner),
            first_id,
            &self.limits(max_new_tokens),
            tokenizer,
            &mut |feed, done| engine.serve(feed, &mut |i, out| done(i, out)),
            env,
        )
    }

    /// The environment, or `None` when the section is off; refuses settings it cannot run
    /// with, naming the key.
    pub fn build(&self) -> std::result::Result<Option<Box<dyn Environment>>, aligner_core::CoreError> {
        let invalid = |m: String| Err(aligner_core::CoreError::Invalid(m));
        if !self.enabled() {
            return Ok(None);
        }
        let set = [
            !self.command.is_empty(),
            self.url.is_some(),
            !self.tools.is_empty(),
        ];
        if set.iter().filter(|&&s| s).count() > 1 {
            return invalid("environment.command, environment.url and environment.tools are three kinds of environment: set one".into());
        }
        if self.max_turns == 0 || self.max_tokens == 0 {
            return invalid(format!(
                "environment.max_turns = {} and environment.max_tokens = {} must both be at least 1",
                self.max_turns, self.max_tokens
            ));
        }
        if !(self.timeout_seconds.is_finite() && self.timeout_seconds > 0.0 && self.error_penalty.is_finite())
        {
            return invalid(format!(
                "environment.timeout_seconds = {} must be a positive number and environment.error_penalty = {} finite",
                self.timeout_seconds, self.error_penalty
            ));
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return invalid(
                "environment.stop_strings has an empty string, which every text contains: each \
                 turn would end at its first token"
                    .into(),
            );
        }
        let timeout = std::time::Duration::from_secs_f64(self.timeout_seconds);
        if !self.command.is_empty() {
            return Ok(Some(Box::new(CommandEnvironment::new(
                "environment",
                self.command.clone(),
                timeout,
            ))));
        }
        if let Some(url) = &self.url {
            return Ok(Some(Box::new(HttpEnvironment::new(
                "environment",
                url.clone(),
                timeout,
            ))));
        }
        aligner_core::train::config::check_template(
            "environment.observation_template",
            &self.observation_template,
            &["result"],
            &["name", "result"],
        )?;
        for (i, tool) in self.tools.iter().enumerate() {
            if tool.command.is_empty() == tool.url.is_none() {
                return invalid(format!(
                    "environment.tools[{i}] (`{}`) needs one of command and url",
                    tool.name
                ));
            }
            if self.tools[..i].iter().any(|t| t.name == tool.name) {
                return invalid(format!("environment.tools declares `{}` twice", tool.name));
            }
        }
        let format = match self.tool_call_regex.as_str() {
            "" => ToolCallFormat::Hermes,
            pattern => ToolCallFormat::Regex(regex::Regex::new(pattern).map_err(|e| {
                aligner_core::CoreError::Invalid(format!("environment.tool_call_regex {pattern:?}: {e}"))
            })?),
        };
        Ok(Some(Box::new(ToolEnvironment::new(
            self.tools.clone(),
            format,
            self.observation_template.clone(),
        ))))
    }

    /// The declared tools as chat templates take them (`None` without tools): a run renders
    /// them into its chat prompts ([`aligner_core::TextTokenizer::with_tools`]).
    pub fn tools_json(&self) -> Option<Value> {
        (!self.tools.is_empty()).then(|| tools_json(&self.tools))
    }

    /// The episode limits, with `max_new_tokens` (the method's) per turn unless set.
    pub fn limits(&self, max_new_tokens: usize) -> EpisodeLimits {
        EpisodeLimits {
            max_turns: self.max_turns,
            max_tokens: self.max_tokens,
            turn_max_new_tokens: match self.turn_max_new_tokens {
                0 => max_new_tokens,
                n => n,
            },
        }
    }
}

/// `{"episode", "turn", "prompt", "response", "metadata"}`: what an external environment
/// receives for one turn.
pub(crate) fn turn_json(turn: &Turn<'_>) -> Value {
    serde_json::to_value(turn).unwrap_or(Value::Null)
}

/// A reply object (`{"observation", "reward", "done"}` or `{"error": "..."}`) as a result.
pub(crate) fn parse_reply(value: &Value) -> TurnResult {
    let shown = |v: &Value| crate::reward::shown(&v.to_string(), 200);
    let Value::Object(fields) = value else {
        return Err(TurnError::env(format!(
            "the reply {} is not a JSON object",
            shown(value)
        )));
    };
    if let Some(error) = fields.get("error") {
        let reason = error.as_str().map_or_else(|| error.to_string(), str::to_string);
        return Err(TurnError::env(format!("the environment says: {reason}")));
    }
    for key in fields.keys() {
        if !["episode", "observation", "reward", "done", "tool_calls"].contains(&key.as_str()) {
            return Err(TurnError::env(format!(
                "the reply {} has an unknown key `{key}` (expected observation, reward, done)",
                shown(value)
            )));
        }
    }
    let mut reply: Reply = serde_json::from_value(value.clone()).map_err(|e| {
        TurnError::env(format!(
            "the reply {} is not {{\"observation\": text, \"reward\": number, \"done\": bool}}: {e}",
            shown(value)
        ))
    })?;
    if reply.reward.is_some_and(|r| !r.is_finite()) {
        return Err(TurnError::env(format!(
            "the reply {} has a non-finite reward",
            shown(value)
        )));
    }
    reply.tool_calls = 0;
    Ok(reply)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The shipped model's tokenizer.
    pub(crate) fn tokenizer() -> TextTokenizer {
        let dir = aligner_core::default_model_dir().expect("the shipped model unpacks");
        TextTokenizer::from_dir(&dir).expect("the shipped tokenizer loads")
    }

    /// An episode starting from `prompt` (its tokens and text), default sampling.
    fn start_of<'a>(
        prompt_ids: &'a [u32],
        prompt: &'a str,
        metadata: &'a Map<String, Value>,
    ) -> EpisodeStart<'a> {
        EpisodeStart {
            prompt_ids,
            prompt,
            metadata,
            params: SamplingParams::default(),
        }
    }

    /// A fake model: each turn answers "a" then ends (EOS), logprob −1 per token.
    fn generate(requests: &[GenerationRequest], tokenizer: &TextTokenizer) -> Vec<Generation> {
        requests
            .iter()
            .map(|r| {
                let mut ids = tokenizer.encode(" yes", false).unwrap();
                ids.truncate(r.params.max_new_tokens);
                Generation {
                    token_logprobs: vec![-1.0; ids.len()],
                    token_ids: ids,
                    stop_reason: StopReason::Eos,
                }
            })
            .collect()
    }

    /// Replies "ok" with reward 1 until the third turn; episode 1 fails on its second turn.
    struct Echo;

    impl Environment for Echo {
        fn name(&self) -> &str {
            "echo"
        }

        fn step(&self, turns: &[Turn<'_>]) -> Vec<TurnResult> {
            turns
                .iter()
                .map(|t| {
                    if t.episode == 11 && t.turn == 1 {
                        return Err(TurnError::env("broken"));
                    }
                    Ok(Reply {
                        observation: Some(" ok.".into()),
                        reward: Some(1.0),
                        done: t.turn == 2,
                        tool_calls: 0,
                    })
                })
                .collect()
        }
    }

    #[test]
    fn episodes_grow_turn_by_turn_with_observations_masked() {
        let tok = tokenizer();
        let prompt = tok.encode("Once upon a time", true).unwrap();
        let metadata = Map::new();
        let start = start_of(&prompt, "Once upon a time", &metadata);
        let limits = EpisodeLimits {
            max_turns: 5,
            max_tokens: 100,
            turn_max_new_tokens: 8,
        };
        let (yes, ok) = (
            tok.encode(" yes", false).unwrap(),
            tok.encode(" ok.", false).unwrap(),
        );
        let mut calls = 0;
        let episodes = run_episodes(
            &[start.clone(), start],
            10,
            &limits,
            &tok,
            &mut |r| {
                calls += 1;
                // Every turn's prompt is the prompt and the episode so far, token for token.
                for request in r {
                    assert_eq!(&request.prompt_ids[..prompt.len()], &prompt[..]);
                }
                Ok(generate(r, &tok))
            },
            &mut |turns| {
                // The environment reads the model's turn alone, decoded.
                assert!(turns.iter().all(|t| t.response.trim() == "yes"));
                Ok(Echo.step(turns))
            },
        )
        .unwrap();
        assert_eq!(calls, 3);
        let e = &episodes[0];
        assert_eq!(e.turns, 3);
        assert_eq!(e.turn_rewards, vec![1.0; 3]);
        let mut want: Vec<u32> = Vec::new();
        let mut observed = Vec::new();
        for _ in 0..3 {
            want.extend(&yes);
            observed.extend(std::iter::repeat_n(false, yes.len()));
            want.extend(&ok);
            observed.extend(std::iter::repeat_n(true, ok.len()));
        }
        assert_eq!(e.generation.token_ids, want);
        assert_eq!(e.observed, observed);
        assert_eq!(e.model_token_ids().len(), 3 * yes.len());
        assert!(
            e.generation
                .token_logprobs
                .iter()
                .zip(&e.observed)
                .all(|(&lp, &o)| (lp == 0.0) == o)
        );
        // The second episode ended at its failing turn, the others untouched.
        let broken = &episodes[1];
        assert_eq!(broken.turns, 2);
        assert_eq!(broken.error, Some(TurnError::env("broken")));
        let stats = EpisodeStats::of(&episodes);
        assert_eq!(stats.env_errors, 1.0);
        assert_eq!(stats.turns, 2.5);
        assert!((stats.reward_per_turn - 4.0 / 5.0).abs() < 1e-12);
    }

    /// The fake model served from a feed, as an engine would.
    fn serve_fake(
        feed: &dyn crate::RequestFeed,
        done: &TurnDone<'_>,
        tokenizer: &TextTokenizer,
    ) -> Result<()> {
        while let Some((key, request)) = feed.next(true)? {
            let out = generate(std::slice::from_ref(&request), tokenizer).remove(0);
            done(key, out)?;
        }
        Ok(())
    }

    #[test]
    fn episodes_in_flight_are_the_lock_step_episodes() {
        let tok = tokenizer();
        let prompt = tok.encode("Once upon a time", true).unwrap();
        let metadata = Map::new();
        let start = start_of(&prompt, "Once upon a time", &metadata);
        let yes = tok.encode(" yes", false).unwrap().len();
        let ok = tok.encode(" ok.", false).unwrap().len();
        for (max_turns, max_tokens) in [(5, 100), (10, yes + ok + 1), (3, 0)] {
            let limits = EpisodeLimits {
                max_turns,
                max_tokens,
                turn_max_new_tokens: 8,
            };
            let starts = vec![start.clone(), start.clone(), start.clone()];
            let lock_step = run_episodes(
                &starts,
                10,
                &limits,
                &tok,
                &mut |r| Ok(generate(r, &tok)),
                &mut |turns| Ok(Echo.step(turns)),
            )
            .unwrap();
            let in_flight = run_episodes_continuous(
                &starts,
                10,
                &limits,
                &tok,
                &mut |feed, done| serve_fake(feed, done, &tok),
                &Echo,
            )
            .unwrap();
            assert_eq!(in_flight, lock_step, "{limits:?}");
        }
    }

    /// A failing engine ends the run with its error; nothing waits for it.
    #[test]
    fn a_failing_engine_stops_episodes_in_flight() {
        let tok = tokenizer();
        let prompt = tok.encode("Once", true).unwrap();
        let metadata = Map::new();
        let start = start_of(&prompt, "Once", &metadata);
        let limits = EpisodeLimits {
            max_turns: 4,
            max_tokens: 50,
            turn_max_new_tokens: 4,
        };
        let mut served = 0;
        let err = run_episodes_continuous(
            &[start.clone(), start],
            0,
            &limits,
            &tok,
            &mut |feed, done| {
                let (key, request) = feed.next(true)?.expect("a first turn");
                done(key, generate(std::slice::from_ref(&request), &tok).remove(0))?;
                served += 1;
                feed.close();
                Err(crate::GenError::WorkerPanicked(3))
            },
            &Echo,
        )
        .unwrap_err();
        assert_eq!(served, 1);
        assert!(err.to_string().contains("worker 3"), "{err}");
    }

    #[test]
    fn the_token_budget_ends_an_episode() {
        let tok = tokenizer();
        let prompt = tok.encode("Once", true).unwrap();
        let metadata = Map::new();
        let start = start_of(&prompt, "Once", &metadata);
        let yes = tok.encode(" yes", false).unwrap().len();
        let ok = tok.encode(" ok.", false).unwrap().len();
        let limits = EpisodeLimits {
            max_turns: 10,
            max_tokens: yes + ok + 1,
            turn_max_new_tokens: 8,
        };
        let episodes = run_episodes(
            &[start],
            0,
            &limits,
            &tok,
            &mut |r| Ok(generate(r, &tok)),
            &mut |turns| Ok(Echo.step(turns)),
        )
        .unwrap();
        assert_eq!(episodes[0].turns, 2);
        assert_eq!(episodes[0].generation.token_ids.len(), limits.max_tokens);
    }

    #[test]
    fn replies_parse_or_say_what_is_wrong() {
        let ok = parse_reply(&serde_json::json!({"episode": 3, "observation": "x", "reward": 0.5})).unwrap();
        assert_eq!(ok.observation.as_deref(), Some("x"));
        assert!(!ok.done);
        let err = |v: Value| parse_reply(&v).unwrap_err().reason;
        assert!(err(serde_json::json!([1])).contains("not a JSON object"));
        assert!(err(serde_json::json!({"observaton": "x"})).contains("unknown key `observaton`"));
        assert!(err(serde_json::json!({"reward": "high"})).contains("not {"));
        assert!(err(serde_json::json!({"error": "no such room"})).contains("no such room"));
    }
}
