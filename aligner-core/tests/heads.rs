//! Chat SFT masking and the multi-output regression head on the shipped model.

use std::path::PathBuf;

use aligner_core::reward::{RewardModel, labels_of, sequence_classification_config};
use aligner_core::sft::{SftExample, SftRow};
use aligner_core::{ChatMessage, Device, LlamaConfig, LoadedModel, TextTokenizer};
use burn::tensor::{Int, Tensor, TensorData};

fn shipped_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets/stories260K")
}

#[test]
fn chat_sft_trains_assistant_turns_only() {
    let tokenizer = TextTokenizer::from_dir(&shipped_dir()).unwrap();
    let msg = |role: &str, content: &str| ChatMessage {
        role: role.into(),
        content: content.into(),
    };
    let row = SftRow::Chat {
        messages: vec![
            msg("user", "Tell me a story."),
            msg("assistant", "Once upon a time there was a cat."),
            msg("user", "More!"),
            msg("assistant", "The cat was happy."),
        ],
    };
    let ex = SftExample::from_row(&row, &tokenizer, 512).unwrap();
    let trained_ids: Vec<u32> = ex
        .ids
        .iter()
        .zip(&ex.trained)
        .filter(|(_, t)| **t)
        .map(|(i, _)| *i)
        .collect();
    let text = tokenizer.decode(&trained_ids, false).unwrap();
    assert!(
        text.contains("cat was happy") && text.contains("there was a cat"),
        "{text}"
    );
    assert!(!text.contains("Tell me") && !text.contains("More!"), "{text}");
    // The assistant turns end with EOS, which is trained too.
    assert_eq!(trained_ids.iter().filter(|&&t| t == 2).count(), 2);
    // Prompt/response rows train the response and a final EOS.
    let pr: SftRow =
        serde_json::from_str(r#"{"prompt": "Once upon a time", "response": " there was a dog."}"#).unwrap();
    let ex = SftExample::from_row(&pr, &tokenizer, 512).unwrap();
    assert_eq!(*ex.ids.last().unwrap(), 2);
    let n_prompt = tokenizer.encode("Once upon a time", true).unwrap().len();
    assert!(ex.trained[..n_prompt].iter().all(|t| !t));
    assert!(ex.trained[n_prompt..].iter().all(|t| *t));
}

#[test]
fn multi_output_head_saves_with_named_labels_and_reloads() {
    let device = Device::flex();
    let lm = LoadedModel::from_dir(&shipped_dir(), &device).unwrap();
    let labels: Vec<String> = ["positivity", "verbosity", "dialogue"].map(String::from).to_vec();
    let mut model = RewardModel::load(&shipped_dir(), &lm.config, 3, &device).unwrap();
    device.seed(5);
    model.score.weight = aligner_core::model::named_param(
        "score.weight",
        Tensor::random([64, 3], burn::tensor::Distribution::Normal(0.0, 0.5), &device),
    );
    let dir = tempfile::tempdir().unwrap();
    model
        .save(&lm.config, &labels, dir.path(), Some(&shipped_dir()))
        .unwrap();
    let config = LlamaConfig::from_file(&dir.path().join("config.json")).unwrap();
    assert_eq!(labels_of(&config), labels);
    assert_eq!(
        config.architectures.as_deref(),
        Some(&["LlamaForSequenceClassification".to_string()][..])
    );
    assert_eq!(
        sequence_classification_config(&lm.config, &labels).pad_token_id,
        Some(0)
    );
    let back = RewardModel::load(dir.path(), &config, 3, &device).unwrap();
    let ids: Vec<i64> = vec![1, 403, 407, 261, 378, 0, 0];
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, 7]), &device);
    let a: Vec<f32> = model
        .forward(tokens.clone(), &[5])
        .into_data()
        .try_to_vec()
        .unwrap();
    let b: Vec<f32> = back
        .forward(tokens.clone(), &[5])
        .into_data()
        .try_to_vec()
        .unwrap();
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-5, "{x} vs {y}");
    }
    // Pooling reads the last real token: padding after it changes nothing.
    let short = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 403, 407, 261, 378], [1, 5]), &device);
    let c: Vec<f32> = back.forward(short, &[5]).into_data().try_to_vec().unwrap();
    for (x, y) in a.iter().zip(&c) {
        assert!((x - y).abs() < 1e-5);
    }
}

#[test]
fn packed_rows_score_each_sequence_as_if_alone() {
    use aligner_core::sft::{SftObjective, pack_examples};
    use aligner_core::train::Objective;
    let device = Device::flex();
    let lm = LoadedModel::from_dir(&shipped_dir(), &device).unwrap();
    let path = shipped_dir().join("../tinystories_sentiment/test.sft.jsonl");
    let examples = aligner_core::sft::load_sft_examples(&path, &lm.tokenizer, 256).unwrap()[..6].to_vec();
    let packed = pack_examples(examples.clone(), 256);
    assert!(packed.len() < examples.len(), "{} rows", packed.len());
    let total = |batch: Vec<&SftExample>| -> (f64, f64) {
        let sums = SftObjective.evaluate(&lm.model, &batch).unwrap();
        (sums[0].sum, sums[0].weight)
    };
    let (alone, n_alone) = examples
        .iter()
        .map(|e| total(vec![e]))
        .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    let (together, n_together) = total(packed.iter().collect());
    assert_eq!(n_alone, n_together);
    assert!(
        (alone - together).abs() < 1e-3 * n_alone,
        "packed NLL {together} vs separate {alone}"
    );
}
