//! Choosing the next token from logits: classifier-free guidance, then greedy, temperature,
//! top-k and top-p, in the order transformers applies them.

use aligner_parallel::fused::host::fast_exp;
use aligner_parallel::fused::infer::{log_sum_exp, row_max, scaled_exp_sum};
use aligner_parallel::fused::sampling_weights;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use rand::Rng;
use serde::{Deserialize, Serialize};

/// How one request samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 = off.
    pub top_p: f32,
    /// Seed of this request's own random stream, so its sample does not depend on what else
    /// is in the batch.
    pub seed: u64,
    pub max_new_tokens: usize,
    /// Generation stops once the decoded response contains one of these.
    pub stop_strings: Vec<String>,
    /// Keep the finished sequence's KV cache in the engine until its next `generate` call, for
    /// a request whose prompt continues this sequence (a multi-turn episode's next turn): that
    /// request prefills only its new tokens.
    pub keep_cache: bool,
}

/// A [`SamplingParams`] field whose value no sampler can use: which, what it was, and what it
/// must be.
#[derive(Debug, Clone, PartialEq)]
pub struct BadSamplingValue {
    pub field: &'static str,
    pub value: String,
    pub rule: &'static str,
}

impl std::fmt::Display for BadSamplingValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: must be {}", self.field, self.value, self.rule)
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            max_new_tokens: 128,
            stop_strings: Vec::new(),
            keep_cache: false,
        }
    }
}

impl SamplingParams {
    /// Refuses values no sampler can use, saying which: a temperature that is negative or not
    /// finite, a `top_p` outside (0, 1], or no new tokens to generate.
    pub fn check(&self) -> std::result::Result<(), BadSamplingValue> {
        let bad = |field, value: String, rule| Err(BadSamplingValue { field, value, rule });
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(
                "temperature",
                self.temperature.to_string(),
                "a finite number of at least 0 (0 = greedy)",
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p.to_string(), "above 0 and at most 1 (1 = off)");
        }
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens", "0".into(), "at least 1");
        }
        Ok(())
    }

    /// Greedy decoding of `max_new_tokens`.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            temperature: 0.0,
            max_new_tokens,
            ..Self::default()
        }
    }
}

/// `log softmax(logits)[token]`.
pub fn log_prob(logits: &[f32], token: usize) -> f32 {
    logits[token] - log_sum_exp(logits)
}

/// Classifier-free guidance (Sanchez et al., 2023; transformers' `guidance_scale`): the
/// next-token log-probs under the prompt, pushed away from those under a negative prompt,
/// `scale · (log p(·|prompt) − log p(·|negative)) + log p(·|negative)`. Scale 1 is the
/// prompt's own distribution, 0 the negative's; above 1 it strengthens whatever the two
/// prompts differ in. Sampling (temperature, top-k, top-p) then applies to the result.
pub fn guided_logits(conditioned: &[f32], negative: &[f32], scale: f32) -> Vec<f32> {
    let (c, n) = (log_sum_exp(conditioned), log_sum_exp(negative));
    conditioned
        .iter()
        .zip(negative)
        .map(|(&x, &y)| {
            let (x, y) = (x - c, y - n);
            // A token the negative prompt rules out stays as the prompt has it (∞ − ∞).
            if y == f32::NEG_INFINITY {
                x
            } else {
                scale * (x - y) + y
            }
        })
        .collect()
}

/// Plain temperature sampling (no top-k/top-p) without writing the distribution: the
/// normaliser, then the inverse CDF walked a block of tokens at a time (block sums first,
/// then the tokens of the block the draw falls in); the log-prob is under the model
/// (temperature 1).
fn sample_unfiltered(logits: &[f32], temperature: f32, rng: &mut impl Rng) -> (usize, f32) {
    const BLOCK: usize = 256;
    let inv_t = 1.0 / temperature;
    let max = row_max(logits);
    let total = scaled_exp_sum(logits, max, inv_t);
    let target = rng.random::<f64>() * total as f64;
    let weight = |l: f32| fast_exp((l - max) * inv_t);
    let mut cumulative = 0.0f64;
    let mut chosen = None;
    for (b, block) in logits.chunks(BLOCK).enumerate() {
        let sum = scaled_exp_sum(block, max, inv_t) as f64;
        if cumulative + sum <= target {
            cumulative += sum;
            continue;
        }
        for (i, &l) in block.iter().enumerate() {
            let w = weight(l);
            if w > 0.0 {
                cumulative += w as f64;
                chosen = Some(b * BLOCK + i);
                if target < cumulative {
                    break;
                }
            }
        }
        break;
    }
    // Rounding can leave the draw past the block's last weight: it takes the last token
    // reached (or, past every block, the last token that has any weight).
    let chosen = chosen.unwrap_or_else(|| logits.iter().rposition(|&l| weight(l) > 0.0).unwrap_or(0));
    let logprob = if temperature == 1.0 {
        logits[chosen] - max - total.ln()
    } else {
        log_prob(logits, chosen)
    };
    (chosen, logprob)
}

/// The uniform draw a request's next token takes, from its own stream: none for greedy, one
/// for temperature sampling, exactly as [`sample`] consumes it (so a request samples the same
/// tokens whichever side draws them).
pub fn device_uniform(params: &SamplingParams, rng: &mut impl Rng) -> f64 {
    if params.temperature <= 0.0 {
        0.0
    } else {
        rng.random::<f64>()
    }
}

/// One row of a draw on the device ([`sample_on_device`]).
#[derive(Debug, Clone, Copy)]
pub struct DeviceRow<'a> {
    pub params: &'a SamplingParams,
    /// The row's uniform draw ([`device_uniform`]; unused when greedy).
    pub uniform: f64,
    /// Classifier-free guidance: the row holding the negative prompt's logits, and the scale.
    pub guidance: Option<(usize, f32)>,
}

/// [`sample`] for every row of `logits: [rows, vocab]` where they are (a GPU's memory): each
/// row's logits, guided against its partner row when it has one ([`guided_logits`]), go
/// through temperature, top-k and top-p on the device
/// ([`aligner_parallel::fused::sampling_weights`], a CubeCL kernel on GPUs); a greedy row takes
/// the argmax, a sampled one the token where its uniform falls in the cumulative weights — the
/// inverse CDF [`sample`] walks on the host. Only each row's token and its log-prob under the
/// model (its own logits, temperature 1) come back: `2·rows` numbers instead of `rows·vocab`.
pub fn sample_on_device(logits: Tensor<2>, rows_in: &[DeviceRow]) -> Vec<(usize, f32)> {
    let [rows, vocab] = logits.dims();
    let device = logits.device();
    let column = |values: Vec<f32>| Tensor::<2>::from_data(TensorData::new(values, [rows, 1]), &device);
    let flags = |values: Vec<bool>| Tensor::<2, Bool>::from_data(TensorData::new(values, [rows, 1]), &device);

    let max = logits.clone().max_dim(1);
    let shifted = logits.clone() - max.clone();
    let log_z = shifted.clone().exp().sum_dim(1).log();
    let draw_from = if rows_in.iter().any(|row| row.guidance.is_some()) {
        guided_on_device(logits, max + log_z.clone(), rows_in)
    } else {
        logits
    };
    let filters: Vec<f32> = rows_in
        .iter()
        .flat_map(|row| {
            let p = row.params;
            let inv_t = if p.temperature > 0.0 {
                1.0 / p.temperature
            } else {
                1.0
            };
            [inv_t, p.top_k as f32, p.top_p]
        })
        .collect();
    let weights = sampling_weights(draw_from.clone(), &filters);
    let cdf = weights.clone().cumsum(1);
    let uniform = column(rows_in.iter().map(|row| row.uniform as f32).collect());
    let target = cdf.clone().narrow(1, vocab - 1, 1) * uniform;
    // The first token whose cumulative weight passes the draw: the count of those before it.
    let drawn = cdf
        .lower_equal(target.expand([rows, vocab]))
        .int()
        .sum_dim(1)
        .clamp_max(vocab as i64 - 1);
    let argmax = draw_from.argmax(1);
    // Rounding can put the draw past the last token with any weight; such a row takes the
    // most likely token instead of one the filters rule out.
    let no_weight = weights.gather(1, drawn.clone()).equal_elem(0.0);
    let greedy = flags(rows_in.iter().map(|row| row.params.temperature <= 0.0).collect());
    let token = drawn.mask_where(greedy.bool_or(no_weight), argmax);
    let logprob = shifted.gather(1, token.clone()) - log_z;
    let both: Vec<f32> = Tensor::cat(vec![token.float(), logprob], 1)
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("draws are floats");
    both.chunks(2).map(|pair| (pair[0] as usize, pair[1])).collect()
}

/// [`guided_logits`] on the device for the rows with guidance (the others keep their logits):
/// `scale · (x − lse(x) − (y − lse(y))) + y − lse(y)`, `x − lse(x)` where `y` is −∞; `lse` is
/// each row's logsumexp `[rows, 1]`.
fn guided_on_device(logits: Tensor<2>, lse: Tensor<2>, rows_in: &[DeviceRow]) -> Tensor<2> {
    let [rows, vocab] = logits.dims();
    let device = logits.device();
    let partner: Vec<i64> = rows_in
        .iter()
        .enumerate()
        .map(|(r, row)| row.guidance.map_or(r, |(p, _)| p) as i64)
        .collect();
    let partner = Tensor::<1, Int>::from_data(TensorData::new(partner, [rows]), &device);
    let scale: Vec<f32> = rows_in
        .iter()
        .map(|row| row.guidance.map_or(1.0, |(_, s)| s))
        .collect();
    let scale = Tensor::<2>::from_data(TensorData::new(scale, [rows, 1]), &device);
    let unguided: Vec<bool> = rows_in.iter().map(|row| row.guidance.is_none()).collect();
    let unguided = Tensor::<2, Bool>::from_data(TensorData::new(unguided, [rows, 1]), &device);
    let own = logits.clone() - lse.clone();
    let negative = logits.clone().select(0, partner.clone()) - lse.select(0, partner);
    let ruled_out = negative.clone().equal_elem(f32::NEG_INFINITY);
    let guided = (own.clone() - negative.clone()) * scale + negative;
    guided
        .mask_where(ruled_out, own)
        .mask_where(unguided.expand([rows, vocab]), logits)
}

/// Index of the largest logit (the first one on ties, like `argmax`).
pub fn argmax(logits: &[f32]) -> usize {
    let max = row_max(logits);
    logits.iter().position(|&l| l == max).unwrap_or(0)
}

/// Probabilities after temperature, top-k and top-p filtering (zero for removed tokens).
pub fn filtered_probs(logits: &[f32], params: &SamplingParams) -> Vec<f64> {
    let t = params.temperature.max(f32::MIN_POSITIVE) as f64;
    let mut scores: Vec<f64> = logits.iter().map(|&l| l as f64 / t).collect();
    if params.top_k > 0 && params.top_k < scores.len() {
        let mut sorted = scores.clone();
        let (_, &mut kth, _) = sorted.select_nth_unstable_by(params.top_k - 1, |a, b| b.total_cmp(a));
        for s in scores.iter_mut().filter(|s| **s < kth) {
            *s = f64::NEG_INFINITY;
        }
    }
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut probs: Vec<f64> = scores.iter().map(|&s| (s - max).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if params.top_p < 1.0 {
        // Remove the least likely tokens whose cumulative mass is at most 1 - top_p, as
        // transformers' TopPLogitsWarper does; the most likely token always stays.
        let mut order: Vec<usize> = (0..probs.len()).collect();
        order.sort_by(|&a, &b| probs[a].total_cmp(&probs[b]));
        let mut cumulative = 0.0;
        let cut = 1.0 - params.top_p as f64;
        for &i in &order[..order.len() - 1] {
            cumulative += probs[i];
            if cumulative > cut {
                break;
            }
            probs[i] = 0.0;
        }
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    probs
}

/// The next token and its log-prob under the model's own distribution (before temperature
/// and filtering — the quantity a trainer recomputes).
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut impl Rng) -> (usize, f32) {
    let token = if params.temperature <= 0.0 {
        argmax(logits)
    } else if params.top_k == 0 && params.top_p >= 1.0 {
        return sample_unfiltered(logits, params.temperature, rng);
    } else {
        let probs = filtered_probs(logits, params);
        let u: f64 = rng.random();
        let mut cumulative = 0.0;
        let mut chosen = argmax(logits);
        for (i, p) in probs.iter().enumerate() {
            if *p == 0.0 {
                continue;
            }
            cumulative += p;
            chosen = i;
            if u < cumulative {
                break;
            }
        }
        chosen
    };
    (token, log_prob(logits, token))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// The device draw takes the same tokens as the host sampler from the same stream
    /// positions — greedy, temperature, top-k, top-p and both, and guided rows, mixed in one
    /// batch — with the model's log-probs; and the streams advance alike, so the next draws
    /// agree too.
    #[test]
    fn device_draws_equal_host_draws() {
        let device = burn::tensor::Device::flex();
        let (rows, vocab) = (40, 301);
        let mut stream = ChaCha8Rng::seed_from_u64(3);
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| {
                // Peaked rows and flat ones, a few tokens ruled out entirely, and ties.
                let scale = if (i / vocab) % 3 == 0 { 6.0 } else { 1.5 };
                if i % 97 == 5 {
                    f32::NEG_INFINITY
                } else if i % 89 == 7 {
                    1.25
                } else {
                    stream.random_range(-scale..scale)
                }
            })
            .collect();
        let filters = [(0, 1.0), (5, 1.0), (0, 0.9), (40, 0.6), (1, 1.0), (0, 0.05)];
        let params: Vec<SamplingParams> = (0..rows)
            .map(|r| SamplingParams {
                temperature: [0.0, 0.5, 1.0, 1.7][r % 4],
                top_k: filters[(r / 4) % filters.len()].0,
                top_p: filters[(r / 4) % filters.len()].1,
                seed: r as u64,
                ..SamplingParams::default()
            })
            .collect();
        // Rows 36.. are two guided requests: 36 against 37, 38 against 39.
        let guidance = |r: usize| match r {
            36 => Some((37, 1.5)),
            38 => Some((39, 3.0)),
            _ => None,
        };
        let negative = |r: usize| r == 37 || r == 39;
        let row = |r: usize| &logits[r * vocab..(r + 1) * vocab];
        let mut host_rngs: Vec<ChaCha8Rng> = (0..rows).map(|r| ChaCha8Rng::seed_from_u64(r as u64)).collect();
        let mut device_rngs = host_rngs.clone();
        let mut sampled = 0;
        for round in 0..3 {
            let host: Vec<(usize, f32)> = (0..rows)
                .map(|r| match guidance(r) {
                    Some((partner, scale)) => {
                        let guided = guided_logits(row(r), row(partner), scale);
                        let (token, _) = sample(&guided, &params[r], &mut host_rngs[r]);
                        (token, log_prob(row(r), token))
                    }
                    None if negative(r) => (0, 0.0),
                    None => sample(row(r), &params[r], &mut host_rngs[r]),
                })
                .collect();
            let device_rows: Vec<DeviceRow> = (0..rows)
                .map(|r| DeviceRow {
                    params: &params[r],
                    uniform: if negative(r) {
                        0.0
                    } else {
                        device_uniform(&params[r], &mut device_rngs[r])
                    },
                    guidance: guidance(r),
                })
                .collect();
            let tensor = Tensor::<2>::from_data(TensorData::new(logits.clone(), [rows, vocab]), &device);
            let on_device = sample_on_device(tensor, &device_rows);
            for r in (0..rows).filter(|&r| !negative(r)) {
                assert_eq!(
                    on_device[r].0, host[r].0,
                    "round {round} row {r} ({:?})",
                    params[r]
                );
                assert!(
                    (on_device[r].1 - host[r].1).abs() < 1e-4,
                    "row {r}: {:?} vs {:?}",
                    on_device[r],
                    host[r]
                );
                assert!(on_device[r].1.is_finite());
                sampled += usize::from(params[r].temperature > 0.0 && host[r].0 != argmax(row(r)));
            }
        }
        // The draws are not all the greedy token: sampling really happened.
        assert!(sampled > 20, "{sampled}");
    }

    /// The filters' weights on the device keep exactly the tokens the host's filtered
    /// probabilities keep, in proportion.
    #[test]
    fn device_filter_weights_follow_the_host_filters() {
        let mut stream = ChaCha8Rng::seed_from_u64(11);
        let vocab = 500;
        let logits: Vec<f32> = (0..vocab).map(|_| stream.random_range(-4.0..4.0)).collect();
        for (top_k, top_p, temperature) in [(10, 1.0, 1.0), (0, 0.8, 0.7), (50, 0.5, 1.3), (0, 1.0, 2.0)] {
            let params = SamplingParams {
                temperature,
                top_k,
                top_p,
                ..SamplingParams::default()
            };
            let host = filtered_probs(&logits, &params);
            let weights = aligner_parallel::fused::filter::sampling_weights_row(
                &logits,
                1.0 / temperature,
                top_k,
                top_p,
            );
            let total: f32 = weights.iter().sum();
            for (h, w) in host.iter().zip(&weights) {
                assert_eq!(*h > 0.0, *w > 0.0, "{params:?}");
                assert!(
                    (*h as f32 - w / total).abs() < 1e-6,
                    "{params:?}: {h} vs {}",
                    w / total
                );
            }
        }
    }

    #[test]
    fn log_prob_is_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((log_prob(&logits, 2) as f64 - (3.0 - z.ln())).abs() < 1e-6);
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let params = SamplingParams::greedy(1);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample(&[0.0, 5.0, 5.0, 1.0], &params, &mut rng).0, 1);
    }

    #[test]
    fn top_k_keeps_the_k_largest() {
        let params = SamplingParams {
            top_k: 2,
            ..SamplingParams::default()
        };
        let probs = filtered_probs(&[1.0, 3.0, 2.0, 0.0], &params);
        assert_eq!(probs[0], 0.0);
        assert_eq!(probs[3], 0.0);
        let e = 1f64.exp();
        assert!((probs[1] - e / (e + 1.0)).abs() < 1e-12);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0.5, 0.3} (0.8 ≥ 0.75).
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let params = SamplingParams {
            top_p: 0.75,
            ..SamplingParams::default()
        };
        let probs = filtered_probs(&logits, &params);
        assert!((probs[0] - 0.625).abs() < 1e-6 && (probs[1] - 0.375).abs() < 1e-6);
        assert_eq!(&probs[2..], &[0.0, 0.0]);
        // A tiny top_p still keeps the most likely token.
        let only = filtered_probs(
            &logits,
            &SamplingParams {
                top_p: 0.01,
                ..params
            },
        );
        assert_eq!(only, vec![1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn temperature_sharpens_and_sampling_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln()];
        let params = SamplingParams::default();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let ones = (0..4000)
            .filter(|_| sample(&logits, &params, &mut rng).0 == 1)
            .count();
        assert!((ones as f64 / 4000.0 - 0.75).abs() < 0.03, "{ones}");
        let cold = filtered_probs(
            &logits,
            &SamplingParams {
                temperature: 0.5,
                ..params
            },
        );
        assert!((cold[1] - 0.9).abs() < 1e-6);
    }

    #[test]
    fn the_reported_logprob_ignores_temperature() {
        let logits = [0.0f32, 1.0, 2.0];
        let params = SamplingParams {
            temperature: 0.3,
            ..SamplingParams::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (token, lp) = sample(&logits, &params, &mut rng);
        assert_eq!(lp, log_prob(&logits, token));
    }

    #[test]
    fn guidance_scales_the_log_prob_difference() {
        // log p(·|prompt) = ln [0.5, 0.25, 0.25], log p(·|negative) = ln [0.25, 0.25, 0.5].
        let conditioned = [2.0f32.ln(), 0.0, 0.0];
        let negative = [0.0f32, 0.0, 2.0f32.ln()];
        let ln = |p: f64| p.ln();
        let expect = |scale: f64| {
            [
                scale * (ln(0.5) - ln(0.25)) + ln(0.25),
                ln(0.25),
                scale * (ln(0.25) - ln(0.5)) + ln(0.5),
            ]
        };
        for scale in [0.0f32, 1.0, 2.0] {
            let got = guided_logits(&conditioned, &negative, scale);
            for (g, e) in got.iter().zip(expect(scale as f64)) {
                assert!((*g as f64 - e).abs() < 1e-6, "scale {scale}: {got:?}");
            }
        }
        // Scale 2: probabilities ∝ [1, 1/4, 1/8]: the first token gains on the third.
        let p: Vec<f64> = filtered_probs(
            &guided_logits(&conditioned, &negative, 2.0),
            &SamplingParams::default(),
        );
        assert!(
            (p[0] - 8.0 / 11.0).abs() < 1e-6 && (p[2] - 1.0 / 11.0).abs() < 1e-6,
            "{p:?}"
        );
    }

    #[test]
    fn the_one_pass_path_draws_what_the_filtered_path_draws() {
        let logits: Vec<f32> = (0..97).map(|i| ((i * 37) % 11) as f32 * 0.4 - 2.0).collect();
        for temperature in [1.0, 0.5, 1.7] {
            let fast = SamplingParams {
                temperature,
                ..SamplingParams::default()
            };
            // top_k = vocab size filters nothing but takes the general path.
            let general = SamplingParams {
                top_k: logits.len(),
                ..fast.clone()
            };
            let (mut a, mut b) = (ChaCha8Rng::seed_from_u64(3), ChaCha8Rng::seed_from_u64(3));
            for _ in 0..300 {
                let (x, lx) = sample(&logits, &fast, &mut a);
                let (y, ly) = sample(&logits, &general, &mut b);
                assert_eq!(x, y);
                assert!((lx - ly).abs() < 1e-5);
            }
        }
    }
}
