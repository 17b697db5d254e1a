//! The sharded-parameter ops against the ops they stand for, in one process (the whole tensor
//! is the one shard): values, and gradients of a random weighting of the outputs with respect
//! to every input. Two and three ranks are `aligner-cli/tests/parallel.rs`'s.

use std::sync::Arc;

use aligner_parallel::Single;
use aligner_parallel::shard::{ShardSpec, shard_embedding, shard_gather, shard_matmul};
use burn::tensor::module::embedding;
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};

fn normal<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

fn spec(dims: &[usize]) -> ShardSpec {
    ShardSpec {
        dims: dims.to_vec(),
        comm: Arc::new(Single),
    }
}

fn max_diff<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f32 {
    let a: Vec<f32> = a.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let b: Vec<f32> = b.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// `x · W` and its gradients in `x` and `W`, with the weight gathered in the backward.
#[test]
fn a_sharded_product_matches_the_product_and_its_gradients() {
    let device = Device::flex().autodiff();
    let x0 = normal([6, 5], &device);
    let w0 = normal([5, 7], &device);
    let weights = normal([6, 7], &device);

    let (x, w) = (x0.clone().require_grad(), w0.clone().require_grad());
    let want = x.clone().matmul(w.clone());
    let grads = (want.clone() * weights.clone()).sum().backward();
    let (want_dx, want_dw) = (x.grad(&grads).unwrap(), w.grad(&grads).unwrap());

    let (x, w) = (x0.require_grad(), w0.require_grad());
    let got = shard_matmul(x.clone(), w.clone(), spec(&[5, 7]));
    assert!(max_diff(got.clone(), want) < 1e-5);
    let grads = (got * weights).sum().backward();
    assert!(max_diff(x.grad(&grads).unwrap(), want_dx) < 1e-5, "dx");
    assert!(max_diff(w.grad(&grads).unwrap(), want_dw) < 1e-5, "dW");
}

/// Rows of a table (a row picked twice adds both gradients) and the table's gradient.
#[test]
fn a_sharded_embedding_matches_the_lookup_and_its_gradient() {
    let device = Device::flex().autodiff();
    let table0 = normal([9, 4], &device);
    let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 3, 3, 8, 0, 1], [2, 3]), &device);
    let weights = normal([2, 3, 4], &device);

    let table = table0.clone().require_grad();
    let want = embedding(table.clone(), ids.clone());
    let grads = (want.clone() * weights.clone()).sum().backward();
    let want_dw = table.grad(&grads).unwrap();

    let table = table0.require_grad();
    let got = shard_embedding(table.clone(), ids, spec(&[9, 4]));
    assert!(max_diff(got.clone(), want) < 1e-6);
    let grads = (got * weights).sum().backward();
    assert!(max_diff(table.grad(&grads).unwrap(), want_dw) < 1e-5);
}

/// A gathered norm weight used with an activation (its anchor): the activation's gradient is
/// untouched by the anchor, the weight's arrives whole.
#[test]
fn a_gathered_parameter_passes_its_gradient_back_and_leaves_its_anchor_alone() {
    let device = Device::flex().autodiff();
    let x0 = normal([3, 4], &device);
    let g0 = normal([4], &device);
    let weights = normal([3, 4], &device);

    let (x, g) = (x0.clone().require_grad(), g0.clone().require_grad());
    let grads = (x.clone() * g.clone().unsqueeze::<2>() * weights.clone())
        .sum()
        .backward();
    let (want_dx, want_dg) = (x.grad(&grads).unwrap(), g.grad(&grads).unwrap());

    let (x, g) = (x0.require_grad(), g0.require_grad());
    let whole = shard_gather(g.clone(), &x, spec(&[4]));
    let grads = (x.clone() * whole.unsqueeze::<2>() * weights).sum().backward();
    assert!(max_diff(x.grad(&grads).unwrap(), want_dx) < 1e-6, "dx");
    assert!(max_diff(g.grad(&grads).unwrap(), want_dg) < 1e-5, "dg");
}
