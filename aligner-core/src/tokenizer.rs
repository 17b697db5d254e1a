//! Tokenizers from `tokenizer.json` and chat templates from `tokenizer_config.json`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{CoreError, Result};

/// One chat message, as in HF chat data: `{"role": "user", "content": "..."}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    #[serde(deserialize_with = "known_role")]
    pub role: String,
    pub content: String,
}

/// The roles chat templates know.
pub const CHAT_ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

fn known_role<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    let role = String::deserialize(d)?;
    if CHAT_ROLES.contains(&role.as_str()) {
        Ok(role)
    } else {
        Err(serde::de::Error::custom(format!(
            "unknown role {role:?} (a message's role is one of {})",
            CHAT_ROLES.join(", ")
        )))
    }
}

/// Used for chat data when the model folder has no `chat_template`: one `role: content` line
/// per message, the model's EOS after each assistant turn.
pub const FALLBACK_CHAT_TEMPLATE: &str = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";

/// A model folder's tokenizer with its special tokens and chat template.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    bos_token: String,
    eos_token: String,
    chat_template: Option<String>,
    /// The tools rendered into every chat prompt (the template's `tools`), for a run whose
    /// model calls them.
    tools: Option<Value>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| CoreError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| CoreError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// A special token given as a string or as `{"content": ...}` in tokenizer_config.json.
fn token_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

fn ids_of(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|v| v as u32).collect(),
        _ => Vec::new(),
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` from a model folder; BOS/EOS ids come from `config.json`, then
    /// `generation_config.json`, then the token strings of `tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| CoreError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let config = read_json(&dir.join("config.json"))?.unwrap_or(Value::Null);
        let generation = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
        let tok_config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);

        let bos_token = token_string(tok_config.get("bos_token"));
        let eos_token = token_string(tok_config.get("eos_token"));
        let by_string = |s: &Option<String>| s.as_deref().and_then(|s| inner.token_to_id(s));
        let bos_id = ids_of(config.get("bos_token_id"))
            .first()
            .copied()
            .or_else(|| ids_of(generation.get("bos_token_id")).first().copied())
            .or_else(|| by_string(&bos_token));
        let mut eos_ids = ids_of(config.get("eos_token_id"));
        if eos_ids.is_empty() {
            eos_ids = ids_of(generation.get("eos_token_id"));
        }
        if eos_ids.is_empty() {
            eos_ids.extend(by_string(&eos_token));
        }
        let name_of = |id: Option<u32>| id.and_then(|i| inner.id_to_token(i));
        let chat_template = match tok_config.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(Value::Array(items)) => items
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(String::from),
            _ => None,
        };
        Ok(Self {
            bos_token: bos_token.or_else(|| name_of(bos_id)).unwrap_or_default(),
            eos_token: eos_token
                .or_else(|| name_of(eos_ids.first().copied()))
                .unwrap_or_default(),
            inner,
            path,
            bos_id,
            eos_ids,
            chat_template,
            tools: None,
        })
    }

    /// This tokenizer rendering `tools` (the OpenAI-style list HF chat templates take as
    /// `tools`) into every chat prompt, as TRL and transformers do for a model that calls them.
    pub fn with_tools(mut self, tools: Value) -> Self {
        self.tools = Some(tools);
        self
    }

    /// Token ids of `text`, with the special tokens the tokenizer's post-processor adds (BOS
    /// for Llama) when `add_special_tokens`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| CoreError::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// Text of `ids`, without special tokens when `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| CoreError::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// Text of `generated` as a continuation of `prompt`: `decode(prompt + generated)` less
    /// `decode(prompt)`. Unlike decoding `generated` alone, this keeps the leading space that
    /// SentencePiece decoders strip, so `prompt_text + continuation` re-encodes to the same ids.
    pub fn decode_continuation(&self, prompt: &[u32], generated: &[u32]) -> Result<String> {
        let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
        let full = self.decode(&all, true)?;
        let prefix = self.decode(prompt, true)?;
        match full.strip_prefix(&prefix) {
            Some(rest) => Ok(rest.to_string()),
            None => self.decode(generated, true),
        }
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The largest id any token (added tokens included) encodes to.
    pub fn max_token_id(&self) -> Option<u32> {
        self.inner.get_vocab(true).into_values().max()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The folder's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders `messages` with the folder's chat template (or [`FALLBACK_CHAT_TEMPLATE`]).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().unwrap_or(FALLBACK_CHAT_TEMPLATE);
        render_chat_template_with_tools(
            template,
            messages,
            add_generation_prompt,
            &self.bos_token,
            &self.eos_token,
            self.tools.as_ref(),
        )
    }
}

/// Renders a HF chat template with minijinja, with the variables and helpers HF templates use
/// (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, Python
/// string methods).
pub fn render_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    render_chat_template_with_tools(
        template,
        messages,
        add_generation_prompt,
        bos_token,
        eos_token,
        None,
    )
}

/// [`render_chat_template`] with the template's `tools` variable set (undefined when `None`,
/// so `{% if tools %}` is false).
pub fn render_chat_template_with_tools(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
    tools: Option<&Value>,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| CoreError::ChatTemplate(e.to_string()))?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| CoreError::ChatTemplate(e.to_string()))?;
    tmpl.render(minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
        tools => tools.map(minijinja::Value::from_serialize),
    })
    .map_err(|e| CoreError::ChatTemplate(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tools reach the template as Qwen2.5's and Hermes' templates read them.
    #[test]
    fn tools_are_rendered_into_the_template() {
        let template = "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\
                        {% endif %}{% for m in messages %}[{{ m.content }}]{% endfor %}";
        let tools = serde_json::json!([{"type": "function", "function": {"name": "lookup"}}]);
        let with = render_chat_template_with_tools(template, &msgs(), false, "", "", Some(&tools)).unwrap();
        assert!(
            with.starts_with("<tools>{") && with.contains(r#""name":"lookup""#),
            "{with}"
        );
        let without = render_chat_template(template, &msgs(), false, "", "").unwrap();
        assert_eq!(without, "[Hi][ Hello ]");
    }

    fn msgs() -> Vec<ChatMessage> {
        vec![
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: " Hello ".into(),
            },
        ]
    }

    #[test]
    fn renders_a_chatml_style_template_with_python_methods() {
        let template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'].strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let out = render_chat_template(template, &msgs(), true, "<s>", "</s>").unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let template =
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}";
        let err = render_chat_template(template, &msgs(), false, "", "").unwrap_err();
        assert!(err.to_string().contains("system first"), "{err}");
    }

    #[test]
    fn fallback_template_marks_assistant_turns_with_eos() {
        let out = render_chat_template(FALLBACK_CHAT_TEMPLATE, &msgs(), false, "<s>", "</s>").unwrap();
        assert_eq!(out, "user: Hi\nassistant:  Hello \n</s>");
    }
}
