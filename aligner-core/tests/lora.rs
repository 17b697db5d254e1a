//! LoRA on the shipped model: only adapters train, merging is exact, adapters switch off to
//! the base, and PEFT-format adapters round-trip.

use std::path::PathBuf;

use aligner_core::adapter::{adapter_tensors, load_adapter, save_adapter};
use aligner_core::checkpoint::hf_tensors;
use aligner_core::model::LoraSpec;
use aligner_core::sft::{CausalLmStore, SftObjective, load_sft_examples};
use aligner_core::train::{TrainSection, Trainer};
use aligner_core::{CausalLm, Device, LoadedModel};
use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn spec() -> LoraSpec {
    LoraSpec {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: ["q_proj", "v_proj", "down_proj"].map(String::from).to_vec(),
    }
}

fn logits(model: &CausalLm) -> Vec<f32> {
    let ids: Vec<i64> = vec![1, 403, 407, 261, 378, 432, 383, 286, 261];
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [1, ids.len()]), &Device::flex());
    model.valid().forward(tokens).into_data().try_to_vec().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn trained_lora_model() -> (LoadedModel, CausalLm) {
    let device = Device::flex();
    let lm = LoadedModel::from_dir(&repo().join("assets/stories260K"), &device).unwrap();
    let mut model = lm.model.clone();
    assert_eq!(model.attach_lora(&spec(), &device), 15);
    let data = repo().join("assets/tinystories_sentiment/train.sft.jsonl");
    let examples = load_sft_examples(&data, &lm.tokenizer, 128).unwrap();
    let out = tempfile::tempdir().unwrap();
    let config = TrainSection {
        max_steps: 4,
        batch_size: 4,
        lr: 1e-2,
        ..TrainSection::default()
    };
    let store = CausalLmStore {
        config: lm.config.clone(),
        tokenizer_dir: lm.dir.clone(),
    };
    let trainer = Trainer {
        config: &config,
        objective: &SftObjective,
        store: &store,
        train: &examples[..16],
        validation: &[],
        run: &aligner_core::run::RunDir::new(out.path()),
        device: device.clone(),
        model_eval: None,
    };
    let (trained, _) = trainer.run(model).unwrap();
    (lm, trained.valid())
}

#[test]
fn only_adapters_train_and_merging_is_exact() {
    let (lm, trained) = trained_lora_model();
    // Every base tensor is bit-identical to the original; the adapters moved.
    assert_eq!(hf_tensors(&lm.model), hf_tensors(&trained));
    let adapters = adapter_tensors(&trained);
    assert_eq!(adapters.len(), 30);
    for (name, _, values) in adapters.iter().filter(|(n, _, _)| n.contains("lora_B")) {
        assert!(values.iter().any(|v| *v != 0.0), "{name} did not train");
    }
    // The merged model computes what base + adapters computes.
    let merged = trained.merged();
    assert!(max_diff(&logits(&trained), &logits(&merged)) < 1e-4);
    // Merged weights are exactly W + (α/r)·A·B, and untargeted layers are untouched.
    let base = hf_tensors(&lm.model);
    let merged_tensors = hf_tensors(&merged);
    let find =
        |set: &[(String, Vec<usize>, Vec<f32>)], n: &str| set.iter().find(|t| t.0 == n).unwrap().2.clone();
    assert_eq!(
        find(&base, "model.layers.0.self_attn.k_proj.weight"),
        find(&merged_tensors, "model.layers.0.self_attn.k_proj.weight")
    );
    let q = "model.layers.2.self_attn.q_proj";
    let a = find(&adapters, &format!("base_model.model.{q}.lora_A.weight")); // [r, in]
    let b = find(&adapters, &format!("base_model.model.{q}.lora_B.weight")); // [out, r]
    let w = find(&base, &format!("{q}.weight")); // [out, in]
    let m = find(&merged_tensors, &format!("{q}.weight"));
    let (d_in, r) = (64, 4);
    for o in [0usize, 17, 63] {
        for i in [0usize, 5, 40] {
            let delta: f32 = (0..r).map(|k| b[o * r + k] * a[k * d_in + i]).sum::<f32>() * 2.0;
            assert!((w[o * d_in + i] + delta - m[o * d_in + i]).abs() < 1e-6);
        }
    }
}

#[test]
fn adapters_switch_off_to_the_base_and_round_trip_in_peft_format() {
    let (lm, trained) = trained_lora_model();
    let base_logits = logits(&lm.model);
    assert!(
        max_diff(&logits(&trained), &base_logits) > 1e-3,
        "training changed nothing"
    );
    let mut off = trained.clone();
    off.model.set_adapters_enabled(false);
    let d = max_diff(&logits(&off), &base_logits);
    assert!(d == 0.0, "adapters off differ from the base by {d}");

    let dir = tempfile::tempdir().unwrap();
    save_adapter(&trained, &spec(), Some(&lm.dir), dir.path()).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    let mut again = lm.model.clone();
    let spec_back = load_adapter(&mut again, dir.path(), &Device::flex()).unwrap();
    assert_eq!(spec_back, spec());
    assert_eq!(adapter_tensors(&again), adapter_tensors(&trained));
    let d = max_diff(&logits(&again), &logits(&trained));
    assert!(d < 1e-4, "reloaded adapter differs by {d}");

    // PPO's offloaded reference: the trained model with its adapters off, copied to the host,
    // is the base to the bit, and with them on the trained model.
    let host = aligner_core::model::copied_to_host(off);
    assert_eq!(logits(&host), base_logits);
    let mut on = host;
    on.model.set_adapters_enabled(true);
    assert_eq!(logits(&on), logits(&trained));
}

/// A LoRA reward model's run-folder save folds the adapters into each weight as the file
/// reaches it (so that ranks holding it in parts need not gather it whole first): the saved
/// classifier is the merged model's own save, and base + adapter + head read back score alike.
#[test]
fn a_lora_reward_model_saves_merged_weights_and_reloads_from_its_adapter() {
    use aligner_core::adapter::RewardLoraStore;
    use aligner_core::reward::RewardModel;
    use aligner_core::store::ModelStore;
    use burn::nn::LinearConfig;
    use burn::tensor::Distribution;

    let (lm, trained) = trained_lora_model();
    let device = Device::flex();
    let labels = vec!["reward".to_string()];
    let mut score = LinearConfig::new(lm.config.hidden_size, 1)
        .with_bias(false)
        .init(&device);
    score.weight = aligner_core::model::named_param(
        "score.weight",
        Tensor::random(
            [lm.config.hidden_size, 1],
            Distribution::Normal(0.0, 0.1),
            &device,
        ),
    );
    let rm = RewardModel {
        model: trained.model.clone(),
        score,
    };
    let store = RewardLoraStore {
        config: lm.config.clone(),
        labels: labels.clone(),
        base_dir: lm.dir.clone(),
        spec: spec(),
    };
    assert!(store.reads_parameters());
    let dir = tempfile::tempdir().unwrap();
    let (saved, merged) = (dir.path().join("lora"), dir.path().join("merged"));
    store.save(&rm, &saved).unwrap();
    RewardModel {
        model: rm.model.merged(),
        score: rm.score.clone(),
    }
    .save(&lm.config, &labels, &merged, Some(&lm.dir))
    .unwrap();
    let read = |dir: &std::path::Path| -> Vec<(String, Vec<f32>)> {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut out: Vec<(String, Vec<f32>)> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let values = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                (name, values)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    };
    let (folded, whole) = (read(&saved), read(&merged));
    assert_eq!(
        folded.iter().map(|t| &t.0).collect::<Vec<_>>(),
        whole.iter().map(|t| &t.0).collect::<Vec<_>>()
    );
    let worst = folded
        .iter()
        .zip(&whole)
        .map(|((_, a), (_, b))| max_diff(a, b))
        .fold(0.0, f32::max);
    assert!(worst < 1e-6, "folded save vs the merged model's: {worst}");
    // The adapters moved the trunk, so the folded weights are not the base's.
    let base = read(&lm.dir);
    let q = "model.layers.2.self_attn.q_proj.weight";
    let find = |set: &[(String, Vec<f32>)]| set.iter().find(|t| t.0 == q).unwrap().1.clone();
    assert!(max_diff(&find(&folded), &find(&base)) > 1e-5);

    let back = store.load(&saved, &device).unwrap();
    let rows: [&[u32]; 2] = [&[1, 403, 407, 261, 378], &[1, 432, 383, 286, 261, 378, 403]];
    let (a, b) = (
        rm.score_rows(&rows, 2).unwrap(),
        back.score_rows(&rows, 2).unwrap(),
    );
    for (x, y) in a.iter().zip(&b) {
        assert!(max_diff(x, y) < 1e-5, "{a:?} vs {b:?}");
    }
}

/// LoRA settings the model cannot train with are refused naming the key, before any adapter
/// is made: a dropout outside [0, 1) (Burn's dropout panicked), targets that name none of the
/// model's projections (the run trained nothing and its backward panicked), and a rank above
/// the narrowest adapted projection (rank 100000 on the shipped model ran for minutes).
#[test]
fn lora_settings_the_model_cannot_take_are_refused_naming_the_key() {
    let lm = LoadedModel::from_dir(&repo().join("assets/stories260K"), &Device::flex()).unwrap();
    let check =
        |spec: LoraSpec| aligner_core::start::check_lora(&spec.for_model(&lm.model.model), &lm.model.model);
    assert!(check(spec()).is_ok());
    let refused = |spec: LoraSpec, key: &str| {
        let message = check(spec).unwrap_err().to_string();
        assert!(message.contains(key), "{message}");
    };
    refused(
        LoraSpec {
            dropout: 2.0,
            ..spec()
        },
        "model.lora_dropout = 2",
    );
    refused(
        LoraSpec {
            alpha: f64::NAN,
            ..spec()
        },
        "model.lora_alpha",
    );
    let nope = LoraSpec {
        targets: vec!["nope".into()],
        ..spec()
    };
    refused(nope, "q_proj");
    // The shipped model's narrowest adapted projection (k_proj and v_proj: 4 key/value heads
    // of 8 dimensions) is 64 × 32.
    refused(LoraSpec { rank: 33, ..spec() }, "at most 32");
    assert!(check(LoraSpec { rank: 32, ..spec() }).is_ok());
}
