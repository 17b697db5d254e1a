//! HF checkpoint folders: round trips, config variants with random weights, dtypes, errors,
//! and the llama2.c converter against the shipped HF folder.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use aligner_core::checkpoint::{hf_tensors, load_causal_lm, save_causal_lm, write_safetensors};
use aligner_core::{CausalLm, CoreError, Device, LlamaConfig, LoadedModel};
use burn::tensor::{Int, Tensor, TensorData};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tensor_map(model: &CausalLm) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    hf_tensors(model)
        .into_iter()
        .map(|(n, s, v)| (n, (s, v)))
        .collect()
}

fn logits(model: &CausalLm, ids: &[i64]) -> Vec<f32> {
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), &Device::flex());
    model.forward(tokens).into_data().try_to_vec().unwrap()
}

fn round_trip(config: &LlamaConfig, dir: &Path) -> (CausalLm, CausalLm) {
    let device = Device::flex();
    device.seed(11);
    let model = CausalLm::new(config, &device);
    save_causal_lm(&model, config, dir, None).unwrap();
    let config_back = LlamaConfig::from_file(&dir.join("config.json")).unwrap();
    let back = load_causal_lm(dir, &config_back, &device).unwrap();
    (model, back)
}

#[test]
fn shipped_model_saves_and_reloads_bit_identically() {
    let device = Device::flex();
    let lm = LoadedModel::from_dir(&repo().join("assets/stories260K"), &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    lm.save(dir.path()).unwrap();
    let again = LoadedModel::from_dir(dir.path(), &device).unwrap();
    assert_eq!(tensor_map(&lm.model), tensor_map(&again.model));
    let ids = [1, 403, 407, 261, 378];
    assert_eq!(logits(&lm.model, &ids), logits(&again.model, &ids));
    // HF layout: tied model has no lm_head, and exactly the tensor names of the original file.
    let original = LoadedModel::from_dir(&repo().join("assets/stories260K"), &device).unwrap();
    let mut names: Vec<String> = tensor_map(&original.model).into_keys().collect();
    names.sort();
    assert_eq!(names.len(), 47);
    assert!(!names.iter().any(|n| n == "lm_head.weight"));
    // The saved file holds the same tensors, value for value, as the shipped one.
    let bytes = std::fs::read(repo().join("assets/stories260K/model.safetensors")).unwrap();
    let shipped = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let saved_bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let saved = safetensors::SafeTensors::deserialize(&saved_bytes).unwrap();
    for name in names {
        assert_eq!(
            shipped.tensor(&name).unwrap().data(),
            saved.tensor(&name).unwrap().data(),
            "{name}"
        );
    }
    assert!(dir.path().join("tokenizer.json").exists());
}

#[test]
fn llama3_rope_scaling_untied_model_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":64,"hidden_size":32,
        "intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
        "max_position_embeddings":64,"rms_norm_eps":1e-5,"tie_word_embeddings":false,
        "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,
        "high_freq_factor":4.0,"original_max_position_embeddings":16}}"#;
    let config = LlamaConfig::from_json_str(text, Path::new("test")).unwrap();
    let (model, back) = round_trip(&config, dir.path());
    let names = tensor_map(&back);
    assert!(names.contains_key("lm_head.weight"));
    assert_eq!(tensor_map(&model), names);
    let ids: Vec<i64> = (0..40).map(|i| (i * 7 % 64) as i64).collect();
    assert_eq!(logits(&model, &ids), logits(&back, &ids));
    let saved = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    assert!(saved.contains("llama3") && saved.contains("rope_parameters"));
}

#[test]
fn qwen2_biases_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let text = r#"{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","vocab_size":50,"hidden_size":16,
        "intermediate_size":24,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":1,
        "rope_theta":1000000.0,"tie_word_embeddings":true,"max_position_embeddings":32}"#;
    let config = LlamaConfig::from_json_str(text, Path::new("test")).unwrap();
    let (model, back) = round_trip(&config, dir.path());
    let names = tensor_map(&back);
    for key in ["q_proj", "k_proj", "v_proj"] {
        assert_eq!(names[&format!("model.layers.1.self_attn.{key}.bias")].0.len(), 1);
    }
    assert!(!names.contains_key("model.layers.0.self_attn.o_proj.bias"));
    assert_eq!(tensor_map(&model), names);
    assert_eq!(logits(&model, &[1, 2, 3]), logits(&back, &[1, 2, 3]));
}

#[test]
fn half_precision_files_load_into_f32() {
    let device = Device::flex();
    let src = repo().join("assets/stories260K");
    let config = LlamaConfig::from_file(&src.join("config.json")).unwrap();
    let original = load_causal_lm(&src, &config, &device).unwrap();
    for dtype in [safetensors::Dtype::F16, safetensors::Dtype::BF16] {
        let dir = tempfile::tempdir().unwrap();
        let tensors = hf_tensors(&original);
        let raw: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(n, s, v)| {
                let bytes = v
                    .iter()
                    .flat_map(|&x| match dtype {
                        safetensors::Dtype::F16 => half::f16::from_f32(x).to_le_bytes(),
                        _ => half::bf16::from_f32(x).to_le_bytes(),
                    })
                    .collect();
                (n.clone(), s.clone(), bytes)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = raw
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(dtype, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        let loaded = load_causal_lm(dir.path(), &config, &device).unwrap();
        let tol = if dtype == safetensors::Dtype::F16 {
            1e-3
        } else {
            1e-2
        };
        let a = tensor_map(&original);
        for (name, (_, values)) in tensor_map(&loaded) {
            for (x, y) in values.iter().zip(&a[&name].1) {
                assert!((x - y).abs() <= tol * y.abs().max(1.0), "{name}: {x} vs {y}");
            }
        }
    }
}

#[test]
fn sharded_checkpoints_load() {
    let device = Device::flex();
    let src = repo().join("assets/stories260K");
    let config = LlamaConfig::from_file(&src.join("config.json")).unwrap();
    let original = load_causal_lm(&src, &config, &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tensors = hf_tensors(&original);
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        write_safetensors(&dir.path().join(file), part).unwrap();
        for (name, _, _) in part {
            map.insert(name.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let loaded = load_causal_lm(dir.path(), &config, &device).unwrap();
    assert_eq!(tensor_map(&loaded), tensor_map(&original));
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let device = Device::flex();
    let src = repo().join("assets/stories260K");
    let config = LlamaConfig::from_file(&src.join("config.json")).unwrap();
    let original = load_causal_lm(&src, &config, &device).unwrap();
    let tensors = hf_tensors(&original);

    let dir = tempfile::tempdir().unwrap();
    let without: Vec<_> = tensors
        .iter()
        .filter(|(n, _, _)| n != "model.layers.3.mlp.up_proj.weight")
        .cloned()
        .collect();
    write_safetensors(&dir.path().join("model.safetensors"), &without).unwrap();
    let err = load_causal_lm(dir.path(), &config, &device).unwrap_err();
    assert!(
        matches!(&err, CoreError::MissingTensor { name, .. } if name == "model.layers.3.mlp.up_proj.weight"),
        "{err}"
    );

    let mut bad = tensors.clone();
    let entry = bad.iter_mut().find(|(n, _, _)| n == "model.norm.weight").unwrap();
    entry.1 = vec![32];
    entry.2.truncate(32);
    write_safetensors(&dir.path().join("model.safetensors"), &bad).unwrap();
    let err = load_causal_lm(dir.path(), &config, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.norm.weight") && err.contains("[64]"), "{err}");

    // An untied config needs lm_head.weight.
    let mut untied = config.clone();
    untied.tie_word_embeddings = Some(false);
    let err = load_causal_lm(&src, &untied, &device).unwrap_err().to_string();
    assert!(err.contains("lm_head.weight"), "{err}");

    // Integer tensors are not weights.
    let ints: Vec<u8> = vec![0; 64 * 4];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![64], &ints).unwrap();
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = Vec::new();
    let raw: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .filter(|(n, _, _)| n != "model.norm.weight")
        .map(|(n, s, v)| {
            (
                n.clone(),
                s.clone(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    for (n, s, b) in &raw {
        views.push((
            n.clone(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
        ));
    }
    views.push(("model.norm.weight".into(), view));
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    let err = load_causal_lm(dir.path(), &config, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.norm.weight") && err.contains("I32"), "{err}");
}

#[test]
fn llama2c_converter_reproduces_the_hf_folder() {
    let device = Device::flex();
    let dir = tempfile::tempdir().unwrap();
    let src = repo().join("assets/stories260K_llama2c");
    let header = aligner_core::llama2c::convert(
        &src.join("stories260K.bin"),
        Some(&src.join("tok512.model")),
        dir.path(),
    )
    .unwrap();
    assert_eq!((header.dim, header.n_layers, header.vocab_size), (64, 5, 512));
    let converted = LoadedModel::from_dir(dir.path(), &device).unwrap();
    let shipped = LoadedModel::from_dir(&repo().join("assets/stories260K"), &device).unwrap();
    assert_eq!(tensor_map(&converted.model), tensor_map(&shipped.model));
    let texts = [
        "Once upon a time, there was a little girl",
        "Tom said, \"I can't find my ball!\" 😀 — naïve café",
        "  double  spaces\nand newlines\t",
    ];
    for text in texts {
        assert_eq!(
            converted.tokenizer.encode(text, true).unwrap(),
            shipped.tokenizer.encode(text, true).unwrap(),
            "{text:?}"
        );
    }
    let ids = shipped.tokenizer.encode(texts[1], true).unwrap();
    assert_eq!(
        converted.tokenizer.decode(&ids, true).unwrap(),
        shipped.tokenizer.decode(&ids, true).unwrap()
    );
    let shipped_config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("assets/stories260K/config.json")).unwrap(),
    )
    .unwrap();
    let converted_config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ] {
        assert_eq!(converted_config[key], shipped_config[key], "{key}");
    }
}

/// Rank `rank` of `size` ranks that never talk: reading a checkpoint's blocks needs only the
/// rank and the group's size.
struct RankOf {
    rank: usize,
    size: usize,
}

impl aligner_parallel::Communicator for RankOf {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    fn all_reduce(
        &self,
        _: &mut [f32],
        _: aligner_parallel::ReduceOp,
    ) -> aligner_parallel::comm::CommResult<()> {
        Err(aligner_parallel::CommError::Failed(
            "loading talks to no rank".into(),
        ))
    }
    fn all_reduce_f64(
        &self,
        _: &mut [f64],
        _: aligner_parallel::ReduceOp,
    ) -> aligner_parallel::comm::CommResult<()> {
        Err(aligner_parallel::CommError::Failed(
            "loading talks to no rank".into(),
        ))
    }
    fn reduce_scatter(&self, _: &[f32], _: &mut [f32]) -> aligner_parallel::comm::CommResult<()> {
        Err(aligner_parallel::CommError::Failed(
            "loading talks to no rank".into(),
        ))
    }
    fn broadcast(&self, _: &mut Vec<u8>, _: usize) -> aligner_parallel::comm::CommResult<()> {
        Err(aligner_parallel::CommError::Failed(
            "loading talks to no rank".into(),
        ))
    }
    fn all_gather(&self, _: &[u8]) -> aligner_parallel::comm::CommResult<Vec<Vec<u8>>> {
        Err(aligner_parallel::CommError::Failed(
            "loading talks to no rank".into(),
        ))
    }
    fn barrier(&self) -> aligner_parallel::comm::CommResult<()> {
        Err(aligner_parallel::CommError::Failed(
            "loading talks to no rank".into(),
        ))
    }
    fn work_queue(
        &self,
        _: usize,
        _: usize,
    ) -> aligner_parallel::comm::CommResult<Box<dyn aligner_parallel::WorkQueue + '_>> {
        Err(aligner_parallel::CommError::Failed(
            "loading talks to no rank".into(),
        ))
    }
    fn traffic(&self) -> aligner_parallel::Traffic {
        aligner_parallel::Traffic::default()
    }
    fn split(
        &self,
        _: usize,
        _: usize,
    ) -> aligner_parallel::comm::CommResult<std::sync::Arc<dyn aligner_parallel::Communicator>> {
        Err(aligner_parallel::CommError::Failed(
            "loading talks to no rank".into(),
        ))
    }
}

/// Checks a tensor group rank's tensors against the whole model's: one of another shape must be
/// exactly rank `rank`'s block of the whole one (along the axis where the shapes differ), any
/// other equal to it. Returns the names of the split tensors and of the whole ones.
fn blocks_of_whole(
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
    whole: &HashMap<String, (Vec<usize>, Vec<f32>)>,
    rank: usize,
    size: usize,
) -> (Vec<String>, Vec<String>) {
    let (mut split, mut unsplit) = (Vec::new(), Vec::new());
    for (name, shape, values) in tensors {
        let (whole_shape, whole_values) = &whole[&name];
        let Some(axis) = (0..shape.len()).find(|&a| shape[a] != whole_shape[a]) else {
            assert_eq!(&values, whole_values, "{name} on rank {rank} of {size}");
            unsplit.push(name);
            continue;
        };
        let range = aligner_parallel::shard_range(whole_shape[axis], rank, size);
        let block = aligner_parallel::tensor::take_block(whole_values, whole_shape, axis, range);
        assert_eq!(values, block, "{name} on rank {rank} of {size}");
        split.push(name);
    }
    (split, unsplit)
}

/// A tensor group's rank reads only its blocks of a checkpoint: each split weight (Gemma 2's
/// fixture: q/k/v/gate/up by output, o/down by input, the embedding and its own output
/// projection by the vocabulary) is exactly that block of the whole tensor, on 2 ranks and on
/// 3 (uneven blocks), and the norms are whole.
#[test]
fn a_tensor_rank_reads_only_its_blocks_of_each_split_weight() {
    let device = Device::flex();
    let dir = repo().join("tests/reference/hf_random/gemma2_capped");
    let config = LlamaConfig::from_file(&dir.join("config.json")).unwrap();
    let whole = tensor_map(&load_causal_lm(&dir, &config, &device).unwrap());
    for size in [2, 3] {
        for rank in 0..size {
            let group: std::sync::Arc<dyn aligner_parallel::Communicator> =
                std::sync::Arc::new(RankOf { rank, size });
            let model =
                aligner_core::checkpoint::load_causal_lm_split(&dir, &config, &device, &group).unwrap();
            let (split, unsplit) = blocks_of_whole(hf_tensors(&model), &whole, rank, size);
            for name in unsplit {
                assert!(
                    !name.contains("proj") && !name.contains("embed"),
                    "{name} was not split"
                );
            }
            // Seven projections a layer, the embedding and the output projection.
            assert_eq!(
                split.len(),
                7 * config.num_hidden_layers + 2,
                "rank {rank} of {size}"
            );
        }
    }
    aligner_parallel::tensor::clear();
}

/// A reward model's trunk on a tensor group's rank is read the same way, from a causal LM's
/// folder (a fresh head) and from a reward model's (its trained head): each split weight of
/// the trunk is this rank's block, and the head stays whole on every rank.
#[test]
fn a_tensor_rank_reads_only_its_blocks_of_a_reward_models_trunk() {
    use aligner_core::checkpoint::{slot_tensors, trunk_slots};
    use aligner_core::reward::RewardModel;
    let device = Device::flex();
    let lm_dir = repo().join("tests/reference/hf_random/llama3_scaled");
    let lm_config = LlamaConfig::from_file(&lm_dir.join("config.json")).unwrap();
    // A reward model's folder: the trunk under a head with values of its own.
    let tmp = tempfile::tempdir().unwrap();
    let mut trained = RewardModel::load(&lm_dir, &lm_config, 2, &device).unwrap();
    trained.score.weight = trained
        .score
        .weight
        .map(|w| w.random_like(burn::tensor::Distribution::Default));
    let labels = ["helpful".to_string(), "tidy".to_string()];
    trained
        .save(&lm_config, &labels, tmp.path(), Some(&lm_dir))
        .unwrap();
    let rm_config = LlamaConfig::from_file(&tmp.path().join("config.json")).unwrap();
    for (dir, config) in [(lm_dir.as_path(), &lm_config), (tmp.path(), &rm_config)] {
        let mut whole = RewardModel::load(dir, config, 2, &device).unwrap();
        let whole_head = whole.score.weight.val().into_data();
        let whole_trunk: HashMap<_, _> = slot_tensors(trunk_slots(&mut whole.model))
            .into_iter()
            .map(|(name, shape, values)| (name, (shape, values)))
            .collect();
        for size in [2, 3] {
            for rank in 0..size {
                let group: std::sync::Arc<dyn aligner_parallel::Communicator> =
                    std::sync::Arc::new(RankOf { rank, size });
                let mut model = RewardModel::load_in(dir, config, 2, &device, Some(&group)).unwrap();
                assert_eq!(
                    model.score.weight.val().into_data(),
                    whole_head,
                    "the head on rank {rank}"
                );
                let trunk = slot_tensors(trunk_slots(&mut model.model));
                let (split, _) = blocks_of_whole(trunk, &whole_trunk, rank, size);
                // Seven projections a layer and the embedding.
                assert_eq!(
                    split.len(),
                    7 * config.num_hidden_layers + 1,
                    "rank {rank} of {size}"
                );
            }
        }
    }
    aligner_parallel::tensor::clear();
}
