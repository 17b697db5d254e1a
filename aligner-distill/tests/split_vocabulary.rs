//! The distillation losses over a vocabulary split across a tensor group (2 and 3 ranks, each a
//! thread of this process, with uneven blocks) against the same losses over the whole
//! vocabulary: the per-position values, and the gradient of a random weighting of them with
//! respect to the student's logits (each rank's block of the whole gradient).

use std::ops::Range;

use aligner_distill::{forward_kl_over, forward_kl_top_k_over, generalized_jsd_over, reverse_kl_over};
use aligner_parallel::comm::Threads;
use aligner_parallel::shard_range;
use aligner_parallel::tensor::Group;
use aligner_parallel::vocab::Vocabulary;
use burn::tensor::{Device, Int, Tensor, TensorData};

const B: usize = 2;
const S: usize = 3;
const VOCAB: usize = 7;
const K: usize = 3;

/// `n` values in [-scale, scale) from a linear congruential stream seeded by `seed`.
fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The columns `cols` of row-major rows of `n` values.
fn columns(values: &[f32], n: usize, cols: Range<usize>) -> Vec<f32> {
    values
        .chunks_exact(n)
        .flat_map(|row| row[cols.clone()].to_vec())
        .collect()
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(diff < 1e-5, "{what}: {diff}");
}

/// A loss of (teacher logits, student logits) over a vocabulary, `[B, S]`.
type Loss = Box<dyn Fn(&Vocabulary, Tensor<3>, Tensor<3>) -> Tensor<2> + Sync>;

/// Each loss, named.
fn losses() -> Vec<(&'static str, Loss)> {
    // The teacher's top-k ids (over the whole vocabulary; some in each block) and log-probs.
    let ids: Vec<i64> = (0..B * S)
        .flat_map(|p| (0..K).map(move |i| ((p * 5 + i * 3) % VOCAB) as i64))
        .collect();
    let top = random(B * S * K, 9, 2.0);
    vec![
        ("forward KL", Box::new(|v, t, s| forward_kl_over(v, t, s, 2.0))),
        ("reverse KL", Box::new(reverse_kl_over)),
        (
            "generalized JSD",
            Box::new(|v, t, s| generalized_jsd_over(v, t, s, 0.3, 0.7)),
        ),
        (
            "JSD at beta 1",
            Box::new(|v, t, s| generalized_jsd_over(v, t, s, 1.0, 1.0)),
        ),
        (
            "top-k forward KL",
            Box::new(move |v, _, s| {
                let device = s.device();
                let ids = Tensor::<3, Int>::from_data(TensorData::new(ids.clone(), [B, S, K]), &device);
                let top = Tensor::<3>::from_data(TensorData::new(top.clone(), [B, S, K]), &device);
                forward_kl_top_k_over(v, ids, top, s, 1.5)
            }),
        ),
    ]
}

#[test]
fn distillation_losses_over_a_split_vocabulary_match_the_whole_vocabulary() {
    // Sharp distributions (logits up to ±6), so a wrong normaliser would show.
    let teacher = random(B * S * VOCAB, 1, 6.0);
    let student = random(B * S * VOCAB, 2, 6.0);
    let weighting = random(B * S, 3, 1.0);
    for (name, loss) in losses() {
        let device = Device::flex().autodiff();
        let leaf =
            Tensor::<3>::from_data(TensorData::new(student.clone(), [B, S, VOCAB]), &device).require_grad();
        let t = Tensor::<3>::from_data(TensorData::new(teacher.clone(), [B, S, VOCAB]), &device);
        let mix = Tensor::<2>::from_data(TensorData::new(weighting.clone(), [B, S]), &device);
        let want = loss(&Vocabulary::Whole, t, leaf.clone());
        let grads = (want.clone() * mix).sum().backward();
        let (want, want_grad) = (values(want), values(leaf.grad(&grads).unwrap()));
        assert!(
            want.iter().all(|v| v.is_finite() && *v > 1e-3),
            "{name}: {want:?}"
        );
        for size in [2, 3] {
            Threads::run(size, |rank, comm| {
                let device = Device::flex().autodiff();
                let block = shard_range(VOCAB, rank, size);
                let own = |v: &[f32]| {
                    let data = TensorData::new(columns(v, VOCAB, block.clone()), [B, S, block.len()]);
                    Tensor::<3>::from_data(data, &device)
                };
                let leaf = own(&student).require_grad();
                let mix = Tensor::<2>::from_data(TensorData::new(weighting.clone(), [B, S]), &device);
                let vocabulary = Vocabulary::Split {
                    group: Group(comm),
                    block: block.clone(),
                };
                let got = loss(&vocabulary, own(&teacher), leaf.clone());
                let grads = (got.clone() * mix).sum().backward();
                assert_close(&values(got), &want, &format!("{name} on {size} ranks"));
                assert_close(
                    &values(leaf.grad(&grads).unwrap()),
                    &columns(&want_grad, VOCAB, block),
                    &format!("{name}'s gradient, rank {rank} of {size}"),
                );
            });
        }
    }
}

/// The top k of log-probabilities over a split vocabulary (k above the smallest block, so a
/// rank offers fewer than k) are the whole vocabulary's, values and ids, in order.
#[test]
fn top_k_over_a_split_vocabulary_is_the_whole_vocabularys() {
    let logits = random(B * S * VOCAB, 4, 6.0);
    let device = Device::flex();
    let whole = Tensor::<3>::from_data(TensorData::new(logits.clone(), [B, S, VOCAB]), &device);
    let whole = Vocabulary::Whole.log_softmax(whole);
    let (want, want_ids) = Vocabulary::Whole.top_k(whole, K);
    let (want, want_ids) = (
        values(want),
        want_ids.into_data().convert::<i64>().try_to_vec::<i64>().unwrap(),
    );
    for size in [2, 3] {
        Threads::run(size, |rank, comm| {
            let block = shard_range(VOCAB, rank, size);
            let data = TensorData::new(columns(&logits, VOCAB, block.clone()), [B, S, block.len()]);
            let own = Tensor::<3>::from_data(data, &Device::flex());
            let vocabulary = Vocabulary::Split {
                group: Group(comm),
                block,
            };
            let (got, ids) = vocabulary.top_k(vocabulary.log_softmax(own), K);
            assert_close(&values(got), &want, &format!("top {K} on {size} ranks"));
            assert_eq!(
                ids.into_data().convert::<i64>().try_to_vec::<i64>().unwrap(),
                want_ids
            );
        });
    }
}
