//! JSON Lines data files: every line parsed up front, a bad line reported with file and line
//! number, so a run never starts on half-parsed data.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub use crate::error::DataError;
use crate::error::{CoreError, Result};
use crate::tokenizer::{ChatMessage, TextTokenizer};

/// Reads every non-blank line of `path` as a `T`.
pub fn read_jsonl<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    Ok(read_jsonl_numbered(path)?
        .into_iter()
        .map(|(_, row)| row)
        .collect())
}

/// [`read_jsonl`] with each row's line number in the file (from 1; blank lines count).
///
/// A UTF-8 byte-order mark is skipped; a line that is not UTF-8 or not a `T` is an error naming
/// the file and the line, and a file with no rows at all (empty, or blank lines only) is an
/// error naming the file.
pub fn read_jsonl_numbered<T: DeserializeOwned>(path: &Path) -> Result<Vec<(usize, T)>> {
    let bytes = std::fs::read(path).map_err(|e| CoreError::io(path, e))?;
    let bytes = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(&bytes);
    let bad_line = |line: usize, message: String| DataError {
        path: path.to_path_buf(),
        line,
        message,
    };
    let mut rows = Vec::new();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = std::str::from_utf8(raw).map_err(|e| bad_line(i + 1, format!("not UTF-8 text ({e})")))?;
        if line.trim().is_empty() {
            continue;
        }
        let row = parse_line(line).map_err(|e| bad_line(i + 1, e))?;
        rows.push((i + 1, row));
    }
    if rows.is_empty() {
        return Err(CoreError::Config {
            path: path.to_path_buf(),
            message: "no rows: the file is empty or holds only blank lines".into(),
        });
    }
    Ok(rows)
}

/// One JSON line as a `T`; the error names the field it is about (`messages[1].role: ...`).
fn parse_line<T: DeserializeOwned>(line: &str) -> std::result::Result<T, String> {
    let mut json = serde_json::Deserializer::from_str(line);
    let row: T = serde_path_to_error::deserialize(&mut json).map_err(|e| with_field(e, |m| m))?;
    json.end().map_err(|e| e.to_string())?;
    Ok(row)
}

/// A deserialisation error led by the field it is about (`messages[1].role: ...`; bare at the
/// top level), its message passed through `tidy` first.
pub(crate) fn with_field<E: std::fmt::Display>(
    e: serde_path_to_error::Error<E>,
    tidy: impl FnOnce(&str) -> &str,
) -> String {
    let field = e.path().to_string();
    let message = e.into_inner().to_string();
    let message = tidy(&message);
    match field.as_str() {
        "." | "" => message.to_string(),
        _ => format!("{field}: {message}"),
    }
}

/// Every row of a JSON Lines file turned into a training example by `example`; a line that
/// does not parse or cannot be used is an error naming the file and the line.
pub fn load_examples<T: DeserializeOwned, E>(
    path: &Path,
    mut example: impl FnMut(&T) -> Result<E>,
) -> Result<Vec<E>> {
    read_jsonl_numbered::<T>(path)?
        .iter()
        .map(|(line, row)| {
            example(row).map_err(|e| {
                CoreError::Data(DataError {
                    path: path.to_path_buf(),
                    line: *line,
                    message: e.to_string(),
                })
            })
        })
        .collect()
}

/// Writes `rows` as JSON Lines to `path` through a temporary file and a rename.
pub fn write_jsonl<T: Serialize>(path: &Path, rows: &[T]) -> Result<()> {
    let mut text = String::new();
    for row in rows {
        let line = serde_json::to_string(row).map_err(|e| CoreError::Json {
            path: path.to_path_buf(),
            source: e,
        })?;
        text.push_str(&line);
        text.push('\n');
    }
    crate::checkpoint::write_atomic(path, text.as_bytes())
}

/// Appends one JSON line to `path` (a run's per-round or per-iteration record).
pub fn append_jsonl<T: Serialize>(path: &Path, row: &T) -> Result<()> {
    use std::io::Write;
    let line = serde_json::to_string(row).map_err(|e| CoreError::Json {
        path: path.to_path_buf(),
        source: e,
    })?;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| CoreError::cannot_write(path, e))?;
    writeln!(file, "{line}").map_err(|e| CoreError::cannot_write(path, e))
}

/// A prompt given as text or as chat messages (rendered with the model's chat template).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Messages(Vec<ChatMessage>),
}

/// By the JSON type (not serde's untagged guessing), so an error inside the messages names
/// the message and field, and any other type says what a prompt may be.
impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct PromptVisitor;
        impl<'de> serde::de::Visitor<'de> for PromptVisitor {
            type Value = Prompt;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a prompt: a string, or a list of {\"role\", \"content\"} messages")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Prompt, E> {
                Ok(Prompt::Text(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> std::result::Result<Prompt, E> {
                Ok(Prompt::Text(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> std::result::Result<Prompt, A::Error> {
                let messages =
                    Vec::<ChatMessage>::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))?;
                if messages.is_empty() {
                    return Err(serde::de::Error::custom("the prompt's message list is empty"));
                }
                Ok(Prompt::Messages(messages))
            }
        }
        d.deserialize_any(PromptVisitor)
    }
}

impl Prompt {
    /// The prompt text the model sees; messages end with the generation prompt.
    pub fn render(&self, tokenizer: &TextTokenizer) -> Result<String> {
        match self {
            Prompt::Text(text) => Ok(text.clone()),
            Prompt::Messages(messages) => tokenizer.apply_chat_template(messages, true),
        }
    }
}

/// `{"prompt": ...}` — prompts for generation (other keys are ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct PromptRow {
    pub prompt: Prompt,
}

/// Refuses `tokens` that do not fit in a model's `context` with `room` tokens to spare (1 for
/// a prompt that is to be answered, 0 for a whole sequence that is scored), naming the file
/// and line they came from.
pub fn check_fits(
    path: &Path,
    line: usize,
    what: &str,
    tokens: usize,
    context: usize,
    room: usize,
) -> Result<()> {
    if tokens + room > context {
        let why = match room {
            0 => "longer than",
            _ => "which leaves no room for a response in",
        };
        return Err(CoreError::Data(DataError {
            path: path.to_path_buf(),
            line,
            message: format!(
                "the {what} is {tokens} tokens, {why} the model's context of {context} (max_position_embeddings)"
            ),
        }));
    }
    Ok(())
}

/// A prompt of a `{"prompt": ...}` file: its line, its text as the model sees it (chat
/// messages rendered) and its token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedPrompt {
    pub line: usize,
    pub text: String,
    pub ids: Vec<u32>,
}

/// Every prompt of `path`, rendered and encoded, each checked to leave room for a response
/// in `context` tokens; a bad line is an error naming the file and the line.
pub fn load_prompts(path: &Path, tokenizer: &TextTokenizer, context: usize) -> Result<Vec<EncodedPrompt>> {
    read_jsonl_numbered::<PromptRow>(path)?
        .into_iter()
        .map(|(line, row)| {
            let at_line = |e: CoreError| {
                CoreError::Data(DataError {
                    path: path.to_path_buf(),
                    line,
                    message: e.to_string(),
                })
            };
            let text = row.prompt.render(tokenizer).map_err(at_line)?;
            let ids = tokenizer.encode(&text, true).map_err(at_line)?;
            check_fits(path, line, "prompt", ids.len(), context, 1)?;
            Ok(EncodedPrompt { line, text, ids })
        })
        .collect()
}

/// `{"prompt": ..., "response": str}` — SFT data and `aligner score` input.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromptResponseRow {
    pub prompt: Prompt,
    pub response: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_lines_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(
            &path,
            "{\"prompt\": \"a\", \"response\": \"b\"}\n\n{\"prompt\": \"a\"}\n",
        )
        .unwrap();
        let err = read_jsonl::<PromptResponseRow>(&path).unwrap_err().to_string();
        assert!(err.contains("d.jsonl:3"), "{err}");
        assert!(err.contains("response"), "{err}");
    }

    #[test]
    fn empty_files_are_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in [("empty.jsonl", ""), ("blank.jsonl", "\n  \n\n")] {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            let err = read_jsonl::<PromptResponseRow>(&path).unwrap_err().to_string();
            assert!(err.contains(name) && err.contains("no rows"), "{err}");
        }
    }

    #[test]
    fn a_byte_order_mark_is_skipped_and_bad_utf8_names_its_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bom.jsonl");
        std::fs::write(&path, "\u{feff}{\"prompt\": \"a\", \"response\": \"b\"}\r\n").unwrap();
        let rows = read_jsonl::<PromptResponseRow>(&path).unwrap();
        assert_eq!(rows[0].prompt, Prompt::Text("a".into()));
        let path = dir.path().join("latin1.jsonl");
        let mut bytes = b"{\"prompt\": \"a\", \"response\": \"b\"}\n".to_vec();
        bytes.extend_from_slice(b"{\"prompt\": \"caf\xe9\", \"response\": \"b\"}\n");
        std::fs::write(&path, bytes).unwrap();
        let err = read_jsonl::<PromptResponseRow>(&path).unwrap_err().to_string();
        assert!(err.contains("latin1.jsonl:2") && err.contains("UTF-8"), "{err}");
    }

    #[test]
    fn prompts_may_be_text_or_messages() {
        let text: PromptRow = serde_json::from_str(r#"{"prompt": "hi", "extra": 1}"#).unwrap();
        assert_eq!(text.prompt, Prompt::Text("hi".into()));
        let chat: PromptRow =
            serde_json::from_str(r#"{"prompt": [{"role": "user", "content": "hi"}]}"#).unwrap();
        assert!(matches!(chat.prompt, Prompt::Messages(m) if m.len() == 1));
    }

    #[test]
    fn a_bad_row_names_the_field_and_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sft.jsonl");
        let cases = [
            (r#"{"prompt": "a", "response": 5}"#, "response: invalid type"),
            (r#"{"prompt": "a"}"#, "missing field `response`"),
            (r#"{"response": "a"}"#, "missing field `prompt`"),
            (r#"{"prompt": 7, "response": "b"}"#, "prompt: invalid type"),
            (r#"{"text": "a"}"#, "no prompt, response or messages"),
            (r#"{"messages": []}"#, "messages is empty"),
            (
                r#"{"messages": [{"role": "user", "content": "a"}]}"#,
                "no assistant turn",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}"#,
                "messages[1].role: unknown role \"bot\"",
            ),
            (
                r#"{"messages": [{"role": "user"}]}"#,
                "messages[0]: missing field `content`",
            ),
            (
                r#"{"prompt": [], "response": "b"}"#,
                "prompt: the prompt's message list is empty",
            ),
            (
                r#"{"prompt": "a", "response": "b"} trailing"#,
                "trailing characters",
            ),
        ];
        for (line, expected) in cases {
            std::fs::write(
                &path,
                format!("{{\"prompt\": \"ok\", \"response\": \"ok\"}}\n{line}\n"),
            )
            .unwrap();
            let err = read_jsonl::<crate::sft::SftRow>(&path).unwrap_err().to_string();
            assert!(
                err.contains("sft.jsonl:2: ") && err.contains(expected),
                "{line}: {err}"
            );
        }
    }

    #[test]
    fn prompts_longer_than_the_context_name_their_line() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = crate::TextTokenizer::from_dir(&crate::default_model_dir().unwrap()).unwrap();
        let path = dir.path().join("prompts.jsonl");
        let long = "Once upon a time ".repeat(40);
        std::fs::write(
            &path,
            format!("{{\"prompt\": \"Once\"}}\n\n{{\"prompt\": \"{long}\"}}\n"),
        )
        .unwrap();
        let prompts = load_prompts(&path, &tokenizer, 4096).unwrap();
        assert_eq!(prompts.iter().map(|p| p.line).collect::<Vec<_>>(), [1, 3]);
        let err = load_prompts(&path, &tokenizer, 64).unwrap_err().to_string();
        assert!(
            err.contains("prompts.jsonl:3: the prompt is") && err.contains("context of 64"),
            "{err}"
        );
        // A whole scored sequence may fill the context exactly; a prompt must leave room.
        assert!(check_fits(&path, 1, "x", 64, 64, 0).is_ok());
        assert!(check_fits(&path, 1, "x", 64, 64, 1).is_err());
    }
}
