//! `aligner bench episodes`: multi-turn episodes in lock step against in flight, in an
//! environment that takes time to answer.

use std::time::{Duration, Instant};

use aligner_core::{Device, LoadedModel};
use aligner_gen::env::{
    Environment, Episode, EpisodeLimits, EpisodeStart, Reply, Turn, TurnResult, run_episodes,
    run_episodes_continuous,
};
use aligner_gen::{Engine, EngineOptions, SamplingParams};
use anyhow::Result;

/// What the benchmark runs.
pub struct Shape {
    pub episodes: usize,
    pub turns: usize,
    pub new_tokens: usize,
    /// The mean time an answer takes.
    pub latency: Duration,
    pub slots: usize,
}

/// Story openings the shipped model continues.
const OPENINGS: [&str; 8] = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog went to the park.",
    "One day, a big red ball fell into the pond.",
    "Sam wanted to help his mom in the kitchen.",
    "The cat sat under the tree and looked at the bird.",
    "Mia had a new toy car.",
    "It was a sunny day, and Ben went outside to play.",
    "The little fish swam to the bottom of the sea.",
];

/// Answers each turn after a wait fixed per episode and turn (0 to twice `latency`), the turns
/// of a batch side by side; ends each episode after `turns` model turns.
struct Slow {
    latency: Duration,
    turns: usize,
}

impl Slow {
    fn wait(&self, turn: &Turn<'_>) -> Duration {
        // A fixed spread: splitmix64 of the episode and turn.
        let mut x = turn.episode.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (turn.turn as u64);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
        self.latency.mul_f64(2.0 * (x % 1000) as f64 / 1000.0)
    }
}

impl Environment for Slow {
    fn name(&self) -> &str {
        "slow"
    }

    fn step(&self, turns: &[Turn<'_>]) -> Vec<TurnResult> {
        if let Some(longest) = turns.iter().map(|t| self.wait(t)).max() {
            std::thread::sleep(longest);
        }
        turns
            .iter()
            .map(|t| {
                Ok(Reply {
                    observation: Some(" Mom said, \"And then?\"".into()),
                    reward: None,
                    done: t.turn + 1 >= self.turns,
                    tool_calls: 0,
                })
            })
            .collect()
    }
}

pub fn run(device: &Device, model: Option<&std::path::Path>, shape: Shape) -> Result<()> {
    let dir = match model {
        Some(dir) => dir.to_path_buf(),
        None => aligner_core::default_model_dir()?,
    };
    let lm = LoadedModel::from_dir(&dir, device)?;
    let prompts: Vec<Vec<u32>> = OPENINGS
        .iter()
        .map(|text| lm.tokenizer.encode(text, true))
        .collect::<std::result::Result<_, _>>()?;
    let metadata = serde_json::Map::new();
    let starts: Vec<EpisodeStart<'_>> = (0..shape.episodes)
        .map(|i| EpisodeStart {
            prompt_ids: &prompts[i % prompts.len()],
            prompt: OPENINGS[i % OPENINGS.len()],
            metadata: &metadata,
            params: SamplingParams {
                temperature: 1.0,
                seed: i as u64,
                stop_strings: vec![".".into()],
                ..SamplingParams::default()
            },
        })
        .collect();
    let limits = EpisodeLimits {
        max_turns: shape.turns.max(1),
        max_tokens: shape.turns.max(1) * (shape.new_tokens + 16),
        turn_max_new_tokens: shape.new_tokens,
    };
    let env = Slow {
        latency: shape.latency,
        turns: shape.turns.max(1),
    };
    let options = EngineOptions {
        slots: shape.slots.max(1),
        ..EngineOptions::default()
    };
    println!(
        "| mode | episodes × turns | latency (mean) | model tokens | prefills | positions from the cache | decode steps | seconds | model tokens/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for in_flight in [false, true] {
        let mut engine = Engine::for_model(&lm, options.clone());
        let begun = Instant::now();
        let episodes: Vec<Episode> = if in_flight {
            run_episodes_continuous(
                &starts,
                0,
                &limits,
                &lm.tokenizer,
                &mut |feed, done| engine.serve(feed, &mut |i, out| done(i, out)),
                &env,
            )?
        } else {
            run_episodes(
                &starts,
                0,
                &limits,
                &lm.tokenizer,
                &mut |requests| engine.generate(requests),
                &mut |turns| Ok(env.step(turns)),
            )?
        };
        let seconds = begun.elapsed().as_secs_f64();
        let tokens: usize = episodes.iter().map(|e| e.model_token_ids().len()).sum();
        let turns: usize = episodes.iter().map(|e| e.turns).sum();
        let stats = engine.stats();
        println!(
            "| {} | {} × {:.1} | {} ms | {tokens} | {} | {} | {} | {seconds:.2} | {:.0} |",
            if in_flight { "in flight" } else { "lock step" },
            episodes.len(),
            turns as f64 / episodes.len().max(1) as f64,
            shape.latency.as_millis(),
            stats.prefills,
            stats.reused_positions,
            stats.decode_steps,
            tokens as f64 / seconds
        );
    }
    Ok(())
}
