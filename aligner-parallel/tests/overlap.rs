//! The gradient buckets of `aligner_parallel::overlap` in one process (the sum over one rank is
//! the gradient itself): whatever way a gradient takes — through a hook on an earlier
//! micro-batch, through a hook of the last one while its bucket waits, after its bucket has
//! left, or around the hooks — `finish` hands back the gradients a plain backward gives, and
//! the buckets leave during the backward. Two and three ranks are
//! `aligner-cli/tests/parallel.rs`'s.

use aligner_parallel::Single;
use aligner_parallel::overlap::{Overlap, grad_hook, hook_of};
use burn::tensor::{Device, Distribution, Tensor};

fn normal<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// A parameter read through its hook when an overlap is armed (as `aligner_core`'s
/// `param_value` does), itself otherwise.
fn read<const D: usize>(id: u64, value: &Tensor<D>, anchor: &Tensor<2>) -> Tensor<D> {
    match hook_of(id) {
        Some(hook) => grad_hook(value.clone(), anchor, hook),
        None => value.clone(),
    }
}

/// Parameter ids and shapes: `w0` is read around the hooks (as a parameter read without
/// `param_value` would be).
const W0: u64 = 10;
const W1: u64 = 11;
const W2: u64 = 12;
const B: u64 = 13;

struct Params {
    w0: Tensor<2>,
    w1: Tensor<2>,
    w2: Tensor<2>,
    b: Tensor<1>,
}

/// A small network reading `b` twice; its loss against `target`.
fn loss(p: &Params, x: Tensor<2>, target: &Tensor<2>) -> Tensor<1> {
    let h = x.clone().matmul(p.w0.clone()).tanh();
    let h = h.clone().matmul(read(W1, &p.w1, &h)).tanh();
    let y = h.clone().matmul(read(W2, &p.w2, &h)) + read(B, &p.b, &h).unsqueeze();
    let y = y.clone() * read(B, &p.b, &y).unsqueeze();
    (y - target.clone()).square().sum()
}

#[test]
fn bucketed_gradients_equal_the_plain_backwards_whatever_way_they_take() {
    let device = Device::flex().autodiff();
    let params = Params {
        w0: normal([4, 4], &device).require_grad(),
        w1: normal([4, 5], &device).require_grad(),
        w2: normal([5, 3], &device).require_grad(),
        b: normal([3], &device).require_grad(),
    };
    let inputs: Vec<Tensor<2>> = (0..3).map(|_| normal([6, 4], &device)).collect();
    let target = normal([6, 3], &device);
    // What plain backwards give: the sum of three passes' gradients.
    let mut want = [vec![0.0f32; 16], vec![0.0; 20], vec![0.0; 15], vec![0.0; 3]];
    for x in &inputs {
        let grads = loss(&params, x.clone(), &target).backward();
        let parts = [
            values(params.w0.grad(&grads).unwrap()),
            values(params.w1.grad(&grads).unwrap()),
            values(params.w2.grad(&grads).unwrap()),
            values(params.b.grad(&grads).unwrap()),
        ];
        for (sum, part) in want.iter_mut().zip(parts) {
            sum.iter_mut().zip(part).for_each(|(a, b)| *a += b);
        }
    }

    // Buckets of 16 values, from the last parameter: [b] (3; w2 would take it to 18), [w2],
    // [w1] (20: a bucket of its own), [w0].
    let layout = [(W0, 16), (W1, 20), (W2, 15), (B, 3)];
    let mut overlap = Overlap::new(&Single, 16).unwrap();
    let mut unhooked = vec![0.0f32; 16];
    // An earlier micro-batch: the hooked gradients stay on the host, nothing leaves.
    overlap.arm(&layout, false);
    let grads = loss(&params, inputs[0].clone(), &target).backward();
    assert!(
        params.w1.grad(&grads).is_none(),
        "a hooked gradient reached its parameter"
    );
    assert!(params.b.grad(&grads).is_none());
    let part = values(params.w0.grad(&grads).unwrap());
    unhooked.iter_mut().zip(part).for_each(|(a, b)| *a += b);
    // The last micro-batch: every bucket leaves during its backward (w0's too: it has no
    // hooked read to wait for)...
    overlap.arm(&layout, true);
    let grads = loss(&params, inputs[1].clone(), &target).backward();
    let part = values(params.w0.grad(&grads).unwrap());
    unhooked.iter_mut().zip(part).for_each(|(a, b)| *a += b);
    // ... and a second pass of the same step comes after they left: its gradients are late.
    let grads = loss(&params, inputs[2].clone(), &target).backward();
    let part = values(params.w0.grad(&grads).unwrap());
    unhooked.iter_mut().zip(part).for_each(|(a, b)| *a += b);
    let got = overlap
        .finish(&Single, vec![Some(unhooked), None, None, None])
        .unwrap();
    for ((name, want), got) in ["w0", "w1", "w2", "b"].iter().zip(&want).zip(&got) {
        let got = got.as_ref().unwrap_or_else(|| panic!("{name}: no gradient"));
        let diff = want
            .iter()
            .zip(got)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        // The hooks add each read's gradient on the host, the plain backward adds a
        // parameter's two reads first: f32 sums in another order, within rounding of the
        // gradient's size (with these random inputs `b`'s reaches 10³: measured up to 1,695).
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(
            diff < 1e-5 * (1.0 + scale),
            "{name}: {diff} from the plain backwards' gradient (largest {scale})"
        );
    }
    let stats = overlap.stats();
    assert_eq!((stats.steps, stats.buckets, stats.early_buckets), (1, 4, 4));

    // The next step starts clean; a parameter no pass read has no gradient.
    overlap.arm(&layout, true);
    let grads = loss(&params, inputs[0].clone(), &target).backward();
    assert!(params.w2.grad(&grads).is_none());
    let got = overlap.finish(&Single, vec![None; 4]).unwrap();
    assert!(got[0].is_none(), "w0 went around the hooks and was not handed in");
    let one = params
        .w1
        .grad(&loss(&params, inputs[0].clone(), &target).backward());
    let diff = values(one.unwrap())
        .iter()
        .zip(got[1].as_ref().unwrap())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(diff < 1e-5, "w1 after a step: {diff}");
    let stats = overlap.stats();
    assert_eq!((stats.steps, stats.buckets, stats.early_buckets), (2, 8, 8));
}
