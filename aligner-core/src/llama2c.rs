//! Conversion of llama2.c checkpoints (`model.bin` + SentencePiece `tok.model`) into a
//! Hugging Face folder.
//!
//! The legacy llama2.c format is seven little-endian i32 (`dim, hidden_dim, n_layers, n_heads,
//! n_kv_heads, vocab_size, seq_len`; a negative vocab means an untied classifier at the end)
//! followed by f32 arrays. llama2.c applies RoPE to interleaved pairs; HF uses `rotate_half`,
//! so q/k rows are permuted per head: `W.reshape(h, d/h/2, 2, in).transpose(0,2,1,3)`.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::checkpoint::{write_atomic, write_json, write_safetensors};
use crate::config::LlamaConfig;
use crate::error::{CoreError, Result};

/// The header of a llama2.c checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Llama2cHeader {
    pub dim: usize,
    pub hidden_dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab_size: usize,
    pub seq_len: usize,
    pub shared_classifier: bool,
}

struct Reader<'a> {
    data: &'a [f32],
    pos: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<Vec<f32>> {
        let end = self.pos + n;
        if end > self.data.len() {
            return Err(CoreError::Llama2c {
                path: self.path.to_path_buf(),
                message: format!(
                    "file ends inside {what} (needs {end} floats, has {})",
                    self.data.len()
                ),
            });
        }
        let out = self.data[self.pos..end].to_vec();
        self.pos = end;
        Ok(out)
    }
}

/// Permutes q/k rows from llama2.c's interleaved RoPE layout to HF's rotate_half layout.
fn permute_rotary(w: &[f32], n_heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let half = rows / n_heads / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..n_heads {
        for i in 0..half {
            for pair in 0..2 {
                let src = h * 2 * half + i * 2 + pair;
                let dst = h * 2 * half + pair * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Converts `model.bin` (+ `tok.model`) into an HF folder at `out`.
pub fn convert(model_bin: &Path, tokenizer_model: Option<&Path>, out: &Path) -> Result<Llama2cHeader> {
    let bytes = std::fs::read(model_bin).map_err(|e| CoreError::io(model_bin, e))?;
    let bad = |message: String| CoreError::Llama2c {
        path: model_bin.to_path_buf(),
        message,
    };
    if bytes.len() < 28 || (bytes.len() - 28) % 4 != 0 {
        return Err(bad(format!("{} bytes is not a llama2.c checkpoint", bytes.len())));
    }
    let ints: Vec<i32> = bytes[..28]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if ints.iter().enumerate().any(|(i, &v)| v == 0 || (i != 5 && v < 0)) {
        return Err(bad(format!("implausible header {ints:?}")));
    }
    let h = Llama2cHeader {
        dim: ints[0] as usize,
        hidden_dim: ints[1] as usize,
        n_layers: ints[2] as usize,
        n_heads: ints[3] as usize,
        n_kv_heads: ints[4] as usize,
        vocab_size: ints[5].unsigned_abs() as usize,
        seq_len: ints[6] as usize,
        shared_classifier: ints[5] > 0,
    };
    if !h.dim.is_multiple_of(h.n_heads) || !h.n_heads.is_multiple_of(h.n_kv_heads) {
        return Err(bad(format!("inconsistent heads in header {ints:?}")));
    }
    let floats: Vec<f32> = bytes[28..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut r = Reader {
        data: &floats,
        pos: 0,
        path: model_bin,
    };
    let (d, f, l, v) = (h.dim, h.hidden_dim, h.n_layers, h.vocab_size);
    let head = d / h.n_heads;
    let kv = h.n_kv_heads * head;
    let emb = r.take(v * d, "token_embedding")?;
    let rms_att = r.take(l * d, "rms_att_weight")?;
    let wq = r.take(l * d * d, "wq")?;
    let wk = r.take(l * kv * d, "wk")?;
    let wv = r.take(l * kv * d, "wv")?;
    let wo = r.take(l * d * d, "wo")?;
    let rms_ffn = r.take(l * d, "rms_ffn_weight")?;
    let w1 = r.take(l * f * d, "w1")?;
    let w2 = r.take(l * d * f, "w2")?;
    let w3 = r.take(l * f * d, "w3")?;
    let rms_final = r.take(d, "rms_final_weight")?;
    r.take(h.seq_len * head / 2 * 2, "freq_cis")?;
    let wcls = if h.shared_classifier {
        None
    } else {
        Some(r.take(v * d, "wcls")?)
    };
    if r.pos != floats.len() {
        return Err(bad(format!(
            "{} trailing floats after the weights",
            floats.len() - r.pos
        )));
    }

    let layer = |all: &[f32], i: usize, n: usize| all[i * n..(i + 1) * n].to_vec();
    let mut tensors = vec![("model.embed_tokens.weight".to_string(), vec![v, d], emb)];
    for i in 0..l {
        let p = format!("model.layers.{i}");
        tensors.push((
            format!("{p}.input_layernorm.weight"),
            vec![d],
            layer(&rms_att, i, d),
        ));
        tensors.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![d],
            layer(&rms_ffn, i, d),
        ));
        let q = permute_rotary(&layer(&wq, i, d * d), h.n_heads, d, d);
        let k = permute_rotary(&layer(&wk, i, kv * d), h.n_kv_heads, kv, d);
        tensors.push((format!("{p}.self_attn.q_proj.weight"), vec![d, d], q));
        tensors.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, d], k));
        tensors.push((
            format!("{p}.self_attn.v_proj.weight"),
            vec![kv, d],
            layer(&wv, i, kv * d),
        ));
        tensors.push((
            format!("{p}.self_attn.o_proj.weight"),
            vec![d, d],
            layer(&wo, i, d * d),
        ));
        tensors.push((
            format!("{p}.mlp.gate_proj.weight"),
            vec![f, d],
            layer(&w1, i, f * d),
        ));
        tensors.push((
            format!("{p}.mlp.up_proj.weight"),
            vec![f, d],
            layer(&w3, i, f * d),
        ));
        tensors.push((
            format!("{p}.mlp.down_proj.weight"),
            vec![d, f],
            layer(&w2, i, d * f),
        ));
    }
    tensors.push(("model.norm.weight".to_string(), vec![d], rms_final));
    if let Some(wcls) = wcls {
        tensors.push(("lm_head.weight".to_string(), vec![v, d], wcls));
    }

    std::fs::create_dir_all(out).map_err(|e| CoreError::cannot_write(out, e))?;
    write_safetensors(&out.join("model.safetensors"), &tensors)?;
    let mut config = LlamaConfig::llama(v, d, l, h.n_heads, h.n_kv_heads, f);
    config.head_dim = Some(head);
    config.max_position_embeddings = h.seq_len;
    config.tie_word_embeddings = Some(h.shared_classifier);
    config.extra.insert("torch_dtype".into(), "float32".into());
    write_atomic(&out.join("config.json"), config.to_json_string().as_bytes())?;
    let generation = json!({"bos_token_id": 1, "eos_token_id": 2, "do_sample": false});
    write_json(&out.join("generation_config.json"), &generation)?;
    if let Some(tok) = tokenizer_model {
        write_tokenizer(tok, out)?;
    }
    Ok(h)
}

/// A piece of a SentencePiece model: text, score and type (1 = normal, 2 = unknown,
/// 3 = control, 6 = byte).
#[derive(Debug, Clone, PartialEq)]
pub struct SentencePiece {
    pub piece: String,
    pub score: f32,
    pub kind: u64,
}

/// Reads the pieces of a SentencePiece `ModelProto` (field 1, repeated) from its protobuf bytes.
pub fn read_sentencepiece(path: &Path) -> Result<Vec<SentencePiece>> {
    let bytes = std::fs::read(path).map_err(|e| CoreError::io(path, e))?;
    let bad = |message: &str| CoreError::Tokenizer {
        path: path.to_path_buf(),
        message: format!("not a SentencePiece model: {message}"),
    };
    let mut pieces = Vec::new();
    for field in proto_fields(&bytes).map_err(&bad)? {
        if let (1, ProtoValue::Bytes(body)) = field {
            let mut piece = SentencePiece {
                piece: String::new(),
                score: 0.0,
                kind: 1,
            };
            for inner in proto_fields(body).map_err(&bad)? {
                match inner {
                    (1, ProtoValue::Bytes(text)) => {
                        piece.piece =
                            String::from_utf8(text.to_vec()).map_err(|_| bad("piece is not UTF-8"))?;
                    }
                    (2, ProtoValue::Fixed32(bits)) => piece.score = f32::from_bits(bits),
                    (3, ProtoValue::Varint(kind)) => piece.kind = kind,
                    _ => {}
                }
            }
            pieces.push(piece);
        }
    }
    if pieces.is_empty() {
        return Err(bad("no pieces"));
    }
    Ok(pieces)
}

enum ProtoValue<'a> {
    Varint(u64),
    Fixed32(u32),
    Fixed64,
    Bytes(&'a [u8]),
}

fn varint(bytes: &[u8], pos: &mut usize) -> Result<u64, &'static str> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*pos).ok_or("truncated varint")?;
        *pos += 1;
        value |= ((byte & 0x7f) as u64) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("varint too long")
}

/// The top-level `(field number, value)` pairs of a protobuf message.
fn proto_fields(bytes: &[u8]) -> Result<Vec<(u64, ProtoValue<'_>)>, &'static str> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < bytes.len() {
        let key = varint(bytes, &mut pos)?;
        let value = match key & 7 {
            0 => ProtoValue::Varint(varint(bytes, &mut pos)?),
            1 => {
                pos += 8;
                ProtoValue::Fixed64
            }
            2 => {
                let len = varint(bytes, &mut pos)? as usize;
                let body = bytes.get(pos..pos + len).ok_or("truncated field")?;
                pos += len;
                ProtoValue::Bytes(body)
            }
            5 => {
                let raw = bytes.get(pos..pos + 4).ok_or("truncated fixed32")?;
                pos += 4;
                ProtoValue::Fixed32(u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]))
            }
            _ => return Err("unsupported wire type"),
        };
        if pos > bytes.len() {
            return Err("truncated message");
        }
        out.push((key >> 3, value));
    }
    Ok(out)
}

/// The `tokenizer.json` of a Llama-2 style SentencePiece BPE model: BPE with byte fallback,
/// merges derived from the normal pieces the way transformers' converter does (every split of
/// a piece into two vocabulary pieces, ordered by the merged piece's id), BOS added.
pub fn tokenizer_json(pieces: &[SentencePiece]) -> Value {
    let vocab: serde_json::Map<String, Value> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| (p.piece.clone(), Value::from(i)))
        .collect();
    let id = |s: &str| vocab.get(s).and_then(Value::as_u64);
    let mut merges: Vec<(u64, u64, u64, String, String)> = Vec::new();
    for (merged, p) in pieces.iter().enumerate() {
        if p.kind != 1 {
            continue;
        }
        let chars: Vec<(usize, char)> = p.piece.char_indices().collect();
        for &(split, _) in chars.iter().skip(1) {
            let (left, right) = p.piece.split_at(split);
            if let (Some(l), Some(r)) = (id(left), id(right)) {
                merges.push((merged as u64, l, r, left.to_string(), right.to_string()));
            }
        }
    }
    merges.sort();
    let merges: Vec<Value> = merges.into_iter().map(|(_, _, _, l, r)| json!([l, r])).collect();
    let special = |i: usize| {
        json!({"id": i, "content": pieces[i].piece, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let specials: Vec<Value> = (0..pieces.len())
        .filter(|&i| matches!(pieces[i].kind, 2 | 3))
        .map(special)
        .collect();
    let bos = pieces.iter().position(|p| p.piece == "<s>").unwrap_or(1);
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": specials,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}
        ]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    })
}

/// Writes `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` and a copy of
/// the SentencePiece model into `out`.
fn write_tokenizer(tok_model: &Path, out: &Path) -> Result<PathBuf> {
    let pieces = read_sentencepiece(tok_model)?;
    let tokenizer = tokenizer_json(&pieces);
    let path = out.join("tokenizer.json");
    write_json(&path, &tokenizer)?;
    // Validate by loading it back with the tokenizers crate.
    tokenizers::Tokenizer::from_file(&path).map_err(|e| CoreError::Tokenizer {
        path: path.clone(),
        message: e.to_string(),
    })?;
    write_json(
        &out.join("tokenizer_config.json"),
        &json!({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                "unk_token": "<unk>", "pad_token": null, "add_bos_token": true, "add_eos_token": false,
                "legacy": true, "clean_up_tokenization_spaces": false}),
    )?;
    write_json(
        &out.join("special_tokens_map.json"),
        &json!({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    )?;
    let raw = std::fs::read(tok_model).map_err(|e| CoreError::io(tok_model, e))?;
    write_atomic(&out.join("tokenizer.model"), &raw)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_moves_interleaved_pairs_to_halves() {
        // One head of 4 rows (pairs (0,1),(2,3)), one column: rows become [0,2,1,3].
        let w = [0.0, 1.0, 2.0, 3.0];
        assert_eq!(permute_rotary(&w, 1, 4, 1), vec![0.0, 2.0, 1.0, 3.0]);
        // Two heads of 4 rows each, two columns.
        let w: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let p = permute_rotary(&w, 2, 8, 2);
        let rows: Vec<f32> = p.chunks(2).map(|r| r[0] / 2.0).collect();
        assert_eq!(rows, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
    }

    #[test]
    fn truncated_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.bin");
        let header: Vec<u8> = [8i32, 16, 1, 2, 2, 10, 4]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        std::fs::write(&path, &header).unwrap();
        let err = convert(&path, None, &dir.path().join("out"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("token_embedding"), "{err}");
    }
}
