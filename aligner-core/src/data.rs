//! Data files: JSON Lines, a JSON array, Parquet (as Hugging Face `datasets` writes it), or a
//! folder of such shards; every row parsed up front, a bad row reported with file and line
//! (row) number, so a run never starts on half-parsed data. `data.fields` renames columns
//! (`question` → `prompt`) as the rows are read. Rows may take TRL's conversational forms:
//! message lists for prompts and completions, and preference pairs whose prompt is implicit
//! (the leading turns `chosen` and `rejected` share).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

thread_local! {
    /// The column renames of the data file being read (`data.fields`), set by [`with_fields`].
    static FIELDS: RefCell<Option<(PathBuf, BTreeMap<String, String>)>> = const { RefCell::new(None) };
}

/// Runs `read` with `fields` (`data.fields`: a column name → the name aligner reads) applied
/// to the rows of `path` (and of the shards of a folder `path`) — only that data file: caches
/// and other files read meanwhile are left as they are.
pub fn with_fields<R>(path: &Path, fields: &BTreeMap<String, String>, read: impl FnOnce() -> R) -> R {
    if fields.is_empty() {
        return read();
    }
    let earlier = FIELDS.with(|f| f.replace(Some((path.to_path_buf(), fields.clone()))));
    let out = read();
    FIELDS.with(|f| *f.borrow_mut() = earlier);
    out
}

/// The renames that apply to `path`, if any.
fn fields_for(path: &Path) -> Option<BTreeMap<String, String>> {
    FIELDS.with(|f| {
        f.borrow()
            .as_ref()
            .filter(|(data, _)| path == data || path.parent() == Some(data.as_path()))
            .map(|(_, fields)| fields.clone())
    })
}

/// `row` with its columns renamed by `fields`; a rename onto a column the row already has is
/// an error (the row would hold two values for one field).
fn rename_fields(
    mut row: serde_json::Value,
    fields: &BTreeMap<String, String>,
    used: &mut std::collections::BTreeSet<String>,
) -> std::result::Result<serde_json::Value, String> {
    if let Some(object) = row.as_object_mut() {
        for (from, to) in fields {
            if let Some(value) = object.remove(from) {
                used.insert(from.clone());
                if object.contains_key(to) {
                    return Err(format!(
                        "data.fields renames {from:?} to {to:?}, but the row has {to:?} too"
                    ));
                }
                object.insert(to.clone(), value);
            }
        }
    }
    Ok(row)
}

/// The renames of `fields` that no row read so far had a column for, as a message.
fn unused_renames(
    fields: Option<&BTreeMap<String, String>>,
    used: &std::collections::BTreeSet<String>,
) -> Option<String> {
    let unused: Vec<String> = fields?
        .iter()
        .filter(|(from, _)| !used.contains(*from))
        .map(|(from, to)| format!("{from:?} (to {to:?})"))
        .collect();
    (!unused.is_empty()).then(|| format!("data.fields renames {}, a column no row has", unused.join(", ")))
}

/// Rows of every data format: `(line, row)` pairs, the line counting from 1 (a JSON Lines
/// file's line, blank lines included; a JSON array's element or a Parquet file's row).
pub fn read_jsonl_numbered<T: DeserializeOwned>(path: &Path) -> Result<Vec<(usize, T)>> {
    if path.is_dir() {
        return read_folder(path);
    }
    let fields = fields_for(path);
    match path.extension().and_then(|e| e.to_str()) {
        Some("parquet") => rows_from_values(path, read_parquet(path)?, fields.as_ref()),
        Some("json") => rows_from_values(path, read_json_array(path)?, fields.as_ref()),
        _ => read_lines(path, fields.as_ref()),
    }
}

/// Every shard of a folder (`.jsonl`, `.json`, `.parquet`, in name order), rows numbered on
/// across the shards; an error in a shard names the shard.
fn read_folder<T: DeserializeOwned>(dir: &Path) -> Result<Vec<(usize, T)>> {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| CoreError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("jsonl" | "json" | "parquet")
            )
        })
        .collect();
    shards.sort();
    if shards.is_empty() {
        return Err(CoreError::Config {
            path: dir.to_path_buf(),
            message: "no data files in this folder (.jsonl, .json or .parquet)".into(),
        });
    }
    let mut rows = Vec::new();
    for shard in shards {
        let offset = rows.len();
        rows.extend(
            read_jsonl_numbered::<T>(&shard)?
                .into_iter()
                .enumerate()
                .map(|(i, (_, row))| (offset + i + 1, row)),
        );
    }
    Ok(rows)
}

/// The elements of a file holding one JSON array of objects.
fn read_json_array(path: &Path) -> Result<Vec<serde_json::Value>> {
    let bytes = std::fs::read(path).map_err(|e| CoreError::io(path, e))?;
    let bytes = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(&bytes);
    match serde_json::from_slice::<serde_json::Value>(bytes) {
        Ok(serde_json::Value::Array(rows)) => Ok(rows),
        Ok(_) => Err(CoreError::Config {
            path: path.to_path_buf(),
            message:
                "a .json data file holds one array of rows ([{...}, ...]); for one row a line use .jsonl"
                    .into(),
        }),
        Err(e) => {
            // JSON Lines (one object a line) in a .json file.
            let first = bytes.split(|&b| b == b'\n').find(|l| !l.trim_ascii().is_empty());
            let lines = first.is_some_and(|l| serde_json::from_slice::<serde_json::Map<_, _>>(l).is_ok());
            Err(CoreError::Config {
                path: path.to_path_buf(),
                message: match lines {
                    true => format!(
                        "not one JSON array ({e}): it holds JSON Lines (one object a line); name the file .jsonl"
                    ),
                    false => format!("not JSON: {e}"),
                },
            })
        }
    }
}

/// The rows of a Parquet file as JSON objects (nested lists and structs included, so a
/// column of messages reads as a list of `{"role", "content"}`).
fn read_parquet(path: &Path) -> Result<Vec<serde_json::Value>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let bad = |e: parquet::errors::ParquetError| CoreError::Config {
        path: path.to_path_buf(),
        message: format!("not a readable Parquet file: {e}"),
    };
    let file = std::fs::File::open(path).map_err(|e| CoreError::io(path, e))?;
    let reader = SerializedFileReader::new(file).map_err(bad)?;
    reader
        .get_row_iter(None)
        .map_err(bad)?
        .map(|row| row.map(|r| r.to_json_value()).map_err(bad))
        .collect()
}

/// Rows given as JSON values, renamed by `fields` and read as `T`.
fn rows_from_values<T: DeserializeOwned>(
    path: &Path,
    values: Vec<serde_json::Value>,
    fields: Option<&BTreeMap<String, String>>,
) -> Result<Vec<(usize, T)>> {
    let bad_row = |line: usize, message: String| DataError {
        path: path.to_path_buf(),
        line,
        message,
    };
    let mut used = std::collections::BTreeSet::new();
    let rows = values
        .into_iter()
        .enumerate()
        .map(|(i, value)| {
            let value = match fields {
                Some(fields) => rename_fields(value, fields, &mut used).map_err(|m| bad_row(i + 1, m))?,
                None => value,
            };
            let row: T = serde_path_to_error::deserialize(value).map_err(|e| {
                let hint = unused_renames(fields, &used).map(|h| format!(" ({h} so far)"));
                bad_row(i + 1, with_field(e, |m| m) + &hint.unwrap_or_default())
            })?;
            Ok((i + 1, row))
        })
        .collect::<std::result::Result<Vec<_>, DataError>>()?;
    if let Some(message) = unused_renames(fields, &used).filter(|_| !rows.is_empty()) {
        return Err(CoreError::Config {
            path: path.to_path_buf(),
            message,
        });
    }
    if rows.is_empty() {
        return Err(CoreError::Config {
            path: path.to_path_buf(),
            message: "no rows: the file holds none".into(),
        });
    }
    Ok(rows)
}

/// [`read_jsonl`] of a JSON Lines file, with each row's line number in the file (from 1;
/// blank lines count).
///
/// A UTF-8 byte-order mark is skipped; a line that is not UTF-8 or not a `T` is an error naming
/// the file and the line, and a file with no rows at all (empty, or blank lines only) is an
/// error naming the file.
fn read_lines<T: DeserializeOwned>(
    path: &Path,
    fields: Option<&BTreeMap<String, String>>,
) -> Result<Vec<(usize, T)>> {
    let bytes = std::fs::read(path).map_err(|e| CoreError::io(path, e))?;
    let bytes = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(&bytes);
    let bad_line = |line: usize, message: String| DataError {
        path: path.to_path_buf(),
        line,
        message,
    };
    let mut rows = Vec::new();
    let mut used = std::collections::BTreeSet::new();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line = std::str::from_utf8(raw).map_err(|e| bad_line(i + 1, format!("not UTF-8 text ({e})")))?;
        if line.trim().is_empty() {
            continue;
        }
        let row = match fields {
            None => parse_line(line),
            Some(fields) => serde_json::from_str::<serde_json::Value>(line)
                .map_err(|e| e.to_string())
                .and_then(|v| rename_fields(v, fields, &mut used))
                .and_then(|v| {
                    serde_path_to_error::deserialize(v).map_err(|e| {
                        let hint = unused_renames(Some(fields), &used).map(|h| format!(" ({h} so far)"));
                        with_field(e, |m| m) + &hint.unwrap_or_default()
                    })
                }),
        }
        .map_err(|e| match line.trim_start().starts_with('[') && rows.is_empty() {
            // A JSON array (one row per element) read as JSON Lines.
            true => bad_line(
                i + 1,
                format!("{e}: this looks like one JSON array of rows, not JSON Lines (one object a line); name the file .json, or write one row a line"),
            ),
            false => bad_line(i + 1, e),
        })?;
        rows.push((i + 1, row));
    }
    if rows.is_empty() {
        return Err(CoreError::Config {
            path: path.to_path_buf(),
            message: "no rows: the file is empty or holds only blank lines".into(),
        });
    }
    if let Some(message) = unused_renames(fields, &used) {
        return Err(CoreError::Config {
            path: path.to_path_buf(),
            message,
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

/// A completion given as text, or (TRL's conversational form) as the messages that follow the
/// prompt, rendered with the model's chat template after it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Completion {
    Text(String),
    Messages(Vec<ChatMessage>),
}

impl From<String> for Completion {
    fn from(text: String) -> Self {
        Completion::Text(text)
    }
}

impl From<&str> for Completion {
    fn from(text: &str) -> Self {
        Completion::Text(text.to_string())
    }
}

/// By the JSON type, as [`Prompt`].
impl<'de> Deserialize<'de> for Completion {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        match Prompt::deserialize(d)? {
            Prompt::Text(text) => Ok(Completion::Text(text)),
            Prompt::Messages(messages) => Ok(Completion::Messages(messages)),
        }
    }
}

impl Completion {
    /// The completion's text as it follows `prompt` (rendered: `prompt_text`): itself, or for
    /// messages the chat template's rendering of prompt + messages after the prompt's own
    /// rendering (with its generation prompt), as TRL renders conversational pairs.
    pub fn render_after(
        &self,
        prompt: &Prompt,
        prompt_text: &str,
        tokenizer: &TextTokenizer,
    ) -> Result<String> {
        match (self, prompt) {
            (Completion::Text(text), _) => Ok(text.clone()),
            (Completion::Messages(messages), Prompt::Messages(turns)) => {
                let all: Vec<ChatMessage> = turns.iter().chain(messages).cloned().collect();
                let full = tokenizer.apply_chat_template(&all, false)?;
                full.strip_prefix(prompt_text).map(str::to_string).ok_or_else(|| {
                    CoreError::Invalid(
                        "the chat template renders the prompt differently inside the whole conversation, \
                         so the completion cannot be cut from it"
                            .into(),
                    )
                })
            }
            (Completion::Messages(_), Prompt::Text(_)) => Err(CoreError::Invalid(
                "the completion is a list of messages but the prompt is text: give the prompt as messages too".into(),
            )),
        }
    }
}

/// The prompt and the two responses of a preference row, as text the model reads.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedPair {
    pub prompt: String,
    pub chosen: String,
    pub rejected: String,
}

/// Renders a preference row in any of TRL's forms: text; an explicit prompt (text or messages)
/// with `chosen` / `rejected` as text or message lists; or no prompt, `chosen` and `rejected`
/// being whole conversations whose shared leading turns are the prompt (TRL's implicit prompt).
pub fn render_pair(
    prompt: Option<&Prompt>,
    chosen: &Completion,
    rejected: &Completion,
    tokenizer: &TextTokenizer,
) -> Result<RenderedPair> {
    let implicit;
    let (prompt, chosen, rejected) = match (prompt, chosen, rejected) {
        (Some(prompt), chosen, rejected) => (prompt, chosen.clone(), rejected.clone()),
        (None, Completion::Messages(c), Completion::Messages(r)) => {
            let shared = c.iter().zip(r).take_while(|(a, b)| a == b).count();
            if shared == 0 || shared == c.len() || shared == r.len() {
                return Err(CoreError::Invalid(format!(
                    "no prompt: chosen and rejected share {shared} leading messages; an implicit prompt \
                     is the turns they share, with at least one message of each after it"
                )));
            }
            implicit = Prompt::Messages(c[..shared].to_vec());
            (
                &implicit,
                Completion::Messages(c[shared..].to_vec()),
                Completion::Messages(r[shared..].to_vec()),
            )
        }
        (None, ..) => {
            return Err(CoreError::Invalid(
                "prompt: missing (a text pair needs \"prompt\"; without one, chosen and rejected are \
                 message lists that share their leading turns)"
                    .into(),
            ));
        }
    };
    let prompt_text = prompt.render(tokenizer)?;
    let chosen = chosen
        .render_after(prompt, &prompt_text, tokenizer)
        .map_err(|e| CoreError::Invalid(format!("chosen: {e}")))?;
    let rejected = rejected
        .render_after(prompt, &prompt_text, tokenizer)
        .map_err(|e| CoreError::Invalid(format!("rejected: {e}")))?;
    Ok(RenderedPair {
        prompt: prompt_text,
        chosen,
        rejected,
    })
}

/// `{"prompt": ...}` — prompts for generation; the other keys are kept for what reads them
/// (a reward function's `"answer"`, a target word).
#[derive(Debug, Clone, Deserialize)]
pub struct PromptRow {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub fields: serde_json::Map<String, serde_json::Value>,
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
    /// The row's other fields.
    pub fields: serde_json::Map<String, serde_json::Value>,
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
            Ok(EncodedPrompt {
                line,
                text,
                ids,
                fields: row.fields,
            })
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

    fn message(role: &str, content: &str) -> ChatMessage {
        serde_json::from_value(serde_json::json!({"role": role, "content": content})).unwrap()
    }

    #[test]
    fn an_implicit_prompt_is_the_turns_chosen_and_rejected_share() {
        let tokenizer = crate::TextTokenizer::from_dir(&crate::default_model_dir().unwrap()).unwrap();
        let user = message("user", "Hi");
        let chosen = Completion::Messages(vec![user.clone(), message("assistant", "Good")]);
        let rejected = Completion::Messages(vec![user.clone(), message("assistant", "Bad")]);
        let implicit = render_pair(None, &chosen, &rejected, &tokenizer).unwrap();
        // The fallback template: "role: content" lines, EOS after assistant turns.
        assert_eq!(implicit.prompt, "user: Hi\nassistant: ");
        assert!(
            implicit.chosen.starts_with("Good\n") && implicit.rejected.starts_with("Bad\n"),
            "{implicit:?}"
        );
        let explicit = render_pair(
            Some(&Prompt::Messages(vec![user.clone()])),
            &Completion::Messages(vec![message("assistant", "Good")]),
            &Completion::Messages(vec![message("assistant", "Bad")]),
            &tokenizer,
        )
        .unwrap();
        assert_eq!(explicit, implicit);
        // Nothing shared, everything shared, text without a prompt, messages after a text prompt.
        let other = Completion::Messages(vec![message("user", "Yo"), message("assistant", "Bad")]);
        assert!(render_pair(None, &chosen, &other, &tokenizer).is_err());
        assert!(render_pair(None, &chosen, &chosen, &tokenizer).is_err());
        assert!(
            render_pair(None, &"a".into(), &"b".into(), &tokenizer)
                .unwrap_err()
                .to_string()
                .contains("prompt")
        );
        let mixed = render_pair(Some(&Prompt::Text("Hi".into())), &chosen, &"b".into(), &tokenizer);
        assert!(mixed.unwrap_err().to_string().contains("chosen"));
    }

    #[test]
    fn json_arrays_folders_and_renamed_fields_read_as_rows() {
        let dir = tempfile::tempdir().unwrap();
        let array = dir.path().join("rows.json");
        std::fs::write(&array, r#"[{"question": "a"}, {"question": "b"}]"#).unwrap();
        let fields: BTreeMap<String, String> = [("question".to_string(), "prompt".to_string())].into();
        let rows: Vec<(usize, PromptRow)> =
            with_fields(&array, &fields, || read_jsonl_numbered(&array)).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].0, 2);
        assert!(matches!(&rows[1].1.prompt, Prompt::Text(t) if t == "b"));
        // A rename of a column no row has is refused, naming it.
        let typo: BTreeMap<String, String> = [
            ("question".to_string(), "prompt".to_string()),
            ("answer".to_string(), "response".to_string()),
        ]
        .into();
        let err = with_fields(&array, &typo, || read_jsonl_numbered::<PromptRow>(&array))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data.fields renames \"answer\" (to \"response\"), a column no row has"),
            "{err}"
        );
        let lines = dir.path().join("rows.jsonl");
        std::fs::write(&lines, "{\"prompt\": \"a\"}\n").unwrap();
        let err = with_fields(&lines, &typo, || read_jsonl_numbered::<PromptRow>(&lines))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rows.jsonl") && err.contains("\"question\" (to \"prompt\")"),
            "{err}"
        );
        // Without the rename the column is not a prompt: the error names the file and the row.
        let err = read_jsonl_numbered::<PromptRow>(&array).unwrap_err().to_string();
        assert!(err.contains("rows.json") && err.contains("prompt"), "{err}");
        // JSON and JSON Lines swapped: the error says which format the name promised.
        let swapped = dir.path().join("array.jsonl");
        std::fs::write(&swapped, "[\n  {\"prompt\": \"a\"}\n]\n").unwrap();
        let err = read_jsonl_numbered::<PromptRow>(&swapped)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("array.jsonl:1") && err.contains("name the file .json"),
            "{err}"
        );
        let swapped = dir.path().join("lines.json");
        std::fs::write(&swapped, "{\"prompt\": \"a\"}\n{\"prompt\": \"b\"}\n").unwrap();
        let err = read_jsonl_numbered::<PromptRow>(&swapped)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("lines.json") && err.contains("name the file .jsonl"),
            "{err}"
        );
        // A folder of shards: rows numbered on across them, in name order.
        let shards = dir.path().join("shards");
        std::fs::create_dir_all(&shards).unwrap();
        std::fs::write(shards.join("b.jsonl"), "{\"prompt\": \"3\"}\n").unwrap();
        std::fs::write(shards.join("a.json"), r#"[{"prompt": "1"}, {"prompt": "2"}]"#).unwrap();
        let rows: Vec<(usize, PromptRow)> = read_jsonl_numbered(&shards).unwrap();
        let texts: Vec<String> = rows
            .iter()
            .map(|(_, r)| match &r.prompt {
                Prompt::Text(t) => t.clone(),
                Prompt::Messages(_) => unreachable!(),
            })
            .collect();
        assert_eq!(texts, ["1", "2", "3"]);
        assert_eq!(rows[2].0, 3);
        // Renaming onto a column the row has is refused.
        std::fs::write(&array, r#"[{"question": "a", "prompt": "b"}]"#).unwrap();
        let err = with_fields(&array, &fields, || read_jsonl_numbered::<PromptRow>(&array)).unwrap_err();
        assert!(err.to_string().contains("data.fields"), "{err}");
    }

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
                r#"{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}"#,
                "the row has both messages and prompt: give one form",
            ),
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
