//! The sampling weights of a row of logits after temperature, top-k and top-p, computed
//! where the logits are ([`super::FusedOps::fused_sampling_weights`]): a generation engine
//! draws its next tokens from them without copying the distribution to the host.
//!
//! This file holds the plain host version, the reference the CubeCL kernel
//! ([`super::cube::filter`]) is tested against. Both follow transformers' warpers (and
//! aligner-gen's host sampler): top-k keeps every token scoring at least the k-th largest
//! logit (ties included); top-p then removes the least likely tokens, in ascending order of
//! logit and, among equal logits, of index, while their cumulative mass stays at most
//! `1 − top_p`; the most likely token always stays.

/// Per row, the filter settings a draw uses: `1/temperature`, `top_k` (0 = off) and `top_p`
/// (1 = off), stored as `[inv_t, top_k, top_p]` in the `[rows, 3]` tensor the op takes.
pub const FILTER_PARAMS: usize = 3;

/// `exp((l − max) · inv_t)` for each logit `l` of `logits` the filters keep, 0 for the others
/// (f32, unnormalised).
pub fn sampling_weights_row(logits: &[f32], inv_t: f32, top_k: usize, top_p: f32) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return vec![0.0; logits.len()];
    }
    let kth = if top_k > 0 && top_k < logits.len() {
        let mut sorted = logits.to_vec();
        let (_, &mut kth, _) = sorted.select_nth_unstable_by(top_k - 1, |a, b| b.total_cmp(a));
        kth
    } else {
        f32::NEG_INFINITY
    };
    let mut weights: Vec<f32> = logits
        .iter()
        .map(|&l| if l >= kth { ((l - max) * inv_t).exp() } else { 0.0 })
        .collect();
    if top_p < 1.0 {
        let total: f32 = weights.iter().sum();
        let cut = (1.0 - top_p) * total;
        let mut order: Vec<usize> = (0..logits.len()).filter(|&i| weights[i] > 0.0).collect();
        // A stable sort: equal logits stay in index order.
        order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
        let mut cumulative = 0.0f32;
        for &i in order.iter().take(order.len().saturating_sub(1)) {
            cumulative += weights[i];
            if cumulative > cut {
                break;
            }
            weights[i] = 0.0;
        }
    }
    weights
}

/// [`sampling_weights_row`] for every row of `logits: [rows, vocab]` with `params: [rows,
/// FILTER_PARAMS]`.
pub fn sampling_weights(logits: &[f32], params: &[f32], vocab: usize) -> Vec<f32> {
    logits
        .chunks(vocab.max(1))
        .zip(params.chunks(FILTER_PARAMS))
        .flat_map(|(row, p)| sampling_weights_row(row, p[0], p[1] as usize, p[2]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temperature_alone_weighs_every_token() {
        // Temperature 2: the weights are exp((l − max) / 2).
        let w = sampling_weights_row(&[0.0, 1.0, 2.0], 0.5, 0, 1.0);
        let expected = [(-1.0f32).exp(), (-0.5f32).exp(), 1.0];
        for (a, b) in w.iter().zip(expected) {
            assert!((a - b).abs() < 1e-7, "{w:?}");
        }
    }

    #[test]
    fn top_k_keeps_ties_with_the_kth_logit() {
        let w = sampling_weights_row(&[1.0, 3.0, 2.0, 2.0, 0.5], 1.0, 2, 1.0);
        assert_eq!(
            w.iter().map(|&x| x > 0.0).collect::<Vec<_>>(),
            [false, true, true, true, false]
        );
    }

    #[test]
    fn top_p_removes_the_least_likely_mass_in_order() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 leaves {0.5, 0.3}.
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let kept = |w: Vec<f32>| w.iter().map(|&x| x > 0.0).collect::<Vec<_>>();
        assert_eq!(
            kept(sampling_weights_row(&logits, 1.0, 0, 0.75)),
            [true, true, false, false]
        );
        // The most likely token stays whatever top_p is.
        assert_eq!(
            kept(sampling_weights_row(&logits, 1.0, 0, 1e-6)),
            [true, false, false, false]
        );
        // Equal logits go in index order: the first two of four equal tokens are removed.
        assert_eq!(
            kept(sampling_weights_row(&[0.0; 4], 1.0, 0, 0.5)),
            [false, false, true, true]
        );
    }
}
