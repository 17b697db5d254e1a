//! The methods that sample from the policy as they train — `aligner ppo` (and the GRPO
//! family), `online-dpo`, `rs`, `spin`, `self-reward` and `cai` — each one call into the crate
//! that owns it, and what they print.

use aligner_core::Device;
use anyhow::Result;

use crate::train::{TrainArgs, format_metrics, format_number, prepare};

pub fn ppo(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "ppo")?;
    let summary = aligner_ppo::train(&config, &run, device)?;
    say!("{}", summary.mean_times.table());
    let rewards = (summary.initial_eval_reward, summary.final_eval_reward);
    report_policy("ppo", summary.steps, run.path(), &summary.final_dir, rewards);
    Ok(())
}

/// The line a policy run ends with: its steps, where it is, and the held-out reward before
/// and after (`-` where there is none).
fn report_policy(
    command: &str,
    steps: usize,
    run: &std::path::Path,
    policy: &std::path::Path,
    (before, after): (Option<f64>, Option<f64>),
) {
    let reward = |r: Option<f64>| r.map_or_else(|| "-".to_string(), format_number);
    say!(
        "{command}: {steps} steps; run in {}, policy in {}; eval_reward {} -> {}",
        run.display(),
        policy.display(),
        reward(before),
        reward(after)
    );
}

/// `aligner online-dpo`: pairs of the policy's own answers, judged by the reward, a DPO step
/// each.
pub fn online_dpo(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare::<aligner_dpo::online::OnlineDpoConfig>(&args, "online-dpo")?;
    let summary = aligner_dpo::online::train(&config, &crate::registry::registry(), &run, device)?;
    let rewards = (summary.initial_eval_reward, summary.final_eval_reward);
    report_policy(
        "online-dpo",
        summary.steps,
        run.path(),
        &summary.final_dir,
        rewards,
    );
    Ok(())
}

/// `aligner rs`: best-of-n rejection sampling rounds.
pub fn rs(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare::<aligner_ppo::rejection::RsConfig>(&args, "rs")?;
    let rounds = aligner_ppo::rejection_sampling(&config, &run, device)?;
    for r in &rounds {
        say!(
            "round {}: held-out reward {:.3} -> {:.3}; kept {} best of {} (mean reward {:.3} of all samples, {:.3} kept)",
            r.round,
            r.eval_reward_before,
            r.eval_reward_after,
            r.kept,
            config.rs.n,
            r.sample_reward,
            r.kept_reward
        );
    }
    let last = rounds
        .last()
        .map(|r| format_metrics(&r.frontier))
        .unwrap_or_default();
    say!(
        "rs: {} rounds; run in {}, policy in {}; {last}",
        rounds.len(),
        run.path().display(),
        run.final_dir().display()
    );
    Ok(())
}

/// `aligner self-reward`: self-rewarding iterations.
pub fn self_reward(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare::<aligner_selfreward::SelfRewardConfig>(&args, "self-reward")?;
    let reports = aligner_selfreward::train(&config, &crate::registry::registry(), &run, device)?;
    for r in &reports {
        say!(
            "iteration {}: judge agreement {}; {} pairs of {} prompts; {}",
            r.iteration,
            r.judge_agreement.map_or_else(|| "-".to_string(), format_number),
            r.pairs,
            r.prompts,
            format_metrics(&r.frontier)
        );
    }
    say!(
        "self-reward: {} iterations; run in {}, policy in {}",
        reports.len().saturating_sub(1),
        run.path().display(),
        run.final_dir().display()
    );
    Ok(())
}

/// `aligner cai`: Constitutional AI's supervised and RL-from-AI-feedback stages.
pub fn cai(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare::<aligner_selfreward::cai::CaiConfig>(&args, "cai")?;
    let reports = aligner_selfreward::cai::train(&config, &crate::registry::registry(), &run, device)?;
    for r in &reports {
        let mut parts = Vec::new();
        if let Some(n) = r.revisions {
            parts.push(format!("{n} revisions"));
        }
        if let (Some(n), Some(kept)) = (r.pairs, r.pairs_kept) {
            parts.push(format!("{kept} of {n} AI-labelled pairs kept"));
        }
        if let Some(a) = r.ai_label_agreement {
            parts.push(format!(
                "AI labels agree with {} on {}",
                config.frontier.reward_function.map_or("the check", |f| f.name()),
                format_number(a)
            ));
        }
        if let Some(a) = r.judge_agreement {
            parts.push(format!("judge agreement {}", format_number(a)));
        }
        parts.push(format_metrics(&r.frontier));
        say!("{}: {}", r.stage, parts.join("; "));
    }
    say!(
        "cai: {} stages; run in {}, policy in {}",
        reports.len().saturating_sub(1),
        run.path().display(),
        run.final_dir().display()
    );
    Ok(())
}

/// `aligner spin`: self-play fine-tuning iterations.
pub fn spin(args: TrainArgs, device: &Device) -> Result<()> {
    let (config, run) = prepare(&args, "spin")?;
    let iterations = aligner_spin::train(&config, &crate::registry::registry(), &run, device)?;
    for r in &iterations {
        say!(
            "iteration {}: reference margin of ground truth over its own answers {:.3} ({:.4} per token)",
            r.iteration,
            r.margin,
            r.margin_per_token
        );
    }
    let last = iterations
        .last()
        .map(|r| format_metrics(&r.eval))
        .unwrap_or_default();
    say!(
        "spin: {} iterations; run in {}, policy in {}; {last}",
        iterations.len(),
        run.path().display(),
        run.final_dir().display()
    );
    Ok(())
}
