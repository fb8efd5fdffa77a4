//! Turns bindgen's output into (a) the type and constant bindings, without any `extern` block, and
//! (b) a table of lazily resolved driver functions: one method on `Driver` per declared function.
//!
//! bindgen declares every driver function as `pub fn cuName(args) -> CUresult;` inside an
//! `extern "C"` block. Those declarations would need link-time linking to libcuda, which cudrv
//! never does, so they are removed and replaced by methods that call through pointers resolved
//! on first use (see `src/loader.rs`).

use std::fmt::Write as _;

/// One declared driver function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// The name as declared, with its version suffix (`cuMemAlloc_v2`).
    pub name: String,
    /// The ABI string of the block (`C`, `system`, ...).
    pub abi: String,
    /// `(name, type)` of every parameter.
    pub params: Vec<(String, String)>,
    /// The return type (`CUresult`), or `()`.
    pub ret: String,
}

impl Function {
    /// The name without its `_vN` version suffix (`cuMemAlloc`): what `cuGetProcAddress` takes.
    pub fn base_name(&self) -> &str {
        base_name(&self.name)
    }
}

/// `cuMemAlloc_v2` → `cuMemAlloc`; `cuInit` → `cuInit`.
pub fn base_name(name: &str) -> &str {
    if let Some(pos) = name.rfind("_v") {
        let digits = &name[pos + 2..];
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            return &name[..pos];
        }
    }
    name
}

/// Splits bindgen's output into the bindings without `extern` blocks and the declared functions.
pub fn split(bindings: &str) -> Result<(String, Vec<Function>), String> {
    let mut rest = bindings;
    let mut types = String::with_capacity(bindings.len());
    let mut functions = Vec::new();
    while let Some(start) = find_extern_block(rest) {
        types.push_str(&rest[..start.item_start]);
        let body_start = start.brace + 1;
        let body_len = matching(&rest[body_start..], '{', '}')
            .ok_or_else(|| "unbalanced braces in an extern block".to_string())?;
        let body = &rest[body_start..body_start + body_len];
        for item in split_top_level(body, ';') {
            let item = strip_attributes(item.trim());
            if item.is_empty() {
                continue;
            }
            functions.push(parse_fn(item, &start.abi)?);
        }
        rest = &rest[body_start + body_len + 1..];
    }
    types.push_str(rest);
    if functions.is_empty() {
        return Err("no extern function declarations found in the bindings".into());
    }
    Ok((types, functions))
}

struct ExternStart {
    item_start: usize,
    brace: usize,
    abi: String,
}

fn find_extern_block(text: &str) -> Option<ExternStart> {
    let mut from = 0;
    while let Some(rel) = text[from..].find("extern \"") {
        let at = from + rel;
        let abi_start = at + "extern \"".len();
        let abi_end = abi_start + text[abi_start..].find('"')?;
        let after = text[abi_end + 1..].trim_start();
        if after.starts_with('{') {
            let brace = text.len() - after.len();
            let line_start = text[..at].rfind('\n').map_or(0, |p| p + 1);
            // Include `unsafe ` and any attributes on the same line.
            return Some(ExternStart { item_start: line_start, brace, abi: text[abi_start..abi_end].to_string() });
        }
        from = abi_end;
    }
    None
}

/// Splits at `sep` where no bracket of any kind is open. `->` does not close an angle bracket.
fn split_top_level(text: &str, sep: char) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut last = 0;
    let bytes = text.as_bytes();
    for (i, c) in text.char_indices() {
        match c {
            '(' | '[' | '<' | '{' => depth += 1,
            '>' if i > 0 && bytes[i - 1] == b'-' => {}
            ')' | ']' | '>' | '}' => depth -= 1,
            c if c == sep && depth == 0 => {
                parts.push(&text[last..i]);
                last = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[last..]);
    parts
}

fn strip_attributes(mut item: &str) -> &str {
    while let Some(rest) = item.strip_prefix("#[") {
        let end = matching(rest, '[', ']').unwrap_or(rest.len() - 1);
        item = rest[end + 1..].trim_start();
    }
    item
}

fn parse_fn(item: &str, abi: &str) -> Result<Function, String> {
    let item = item.trim_start_matches("pub ").trim();
    let sig = item.strip_prefix("fn ").ok_or_else(|| format!("not a function: {item}"))?;
    let open = sig.find('(').ok_or_else(|| format!("no parameter list: {item}"))?;
    let name = sig[..open].trim().to_string();
    let close = open + 1 + matching(&sig[open + 1..], '(', ')').ok_or("unbalanced parameters")?;
    let params_text = &sig[open + 1..close];
    let tail = sig[close + 1..].trim();
    let ret = match tail.strip_prefix("->") {
        Some(r) => r.trim().to_string(),
        None => "()".to_string(),
    };
    let mut params = Vec::new();
    for p in split_top_level(params_text, ',') {
        let p = p.trim();
        if p.is_empty() {
            continue;
        }
        if p == "..." {
            return Err(format!("variadic driver function {name} is not supported"));
        }
        let colon = p.find(':').ok_or_else(|| format!("parameter without a name in {name}"))?;
        params.push((p[..colon].trim().to_string(), normalize(p[colon + 1..].trim())));
    }
    Ok(Function { name, abi: abi.to_string(), params, ret: normalize(&ret) })
}

/// The index of the `close` that balances an `open` already consumed, skipping nested pairs.
fn matching(text: &str, open: char, close: char) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            if depth == 0 {
                return Some(i);
            }
            depth -= 1;
        }
    }
    None
}

fn normalize(ty: &str) -> String {
    ty.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Writes the function table and the `Driver` methods.
///
/// A function is resolved through `cuGetProcAddress` (by its base name and the header's
/// `CUDA_VERSION`) only when it is the newest declared variant of its base name. An older variant
/// that is declared beside a newer one (`cuStreamGetCtx` beside `cuStreamGetCtx_v2`) must not be,
/// because `cuGetProcAddress` would hand back the newer ABI; it is resolved by its exact exported
/// name instead.
pub fn generate(functions: &[Function]) -> String {
    let functions = &with_older_variants(functions);
    let mut out = String::new();
    let newest = |f: &Function| {
        !functions.iter().any(|g| g.base_name() == f.base_name() && version_of(&g.name) > version_of(&f.name))
    };
    let _ = writeln!(out, "/// The number of driver functions in the table.");
    let _ = writeln!(out, "pub const FUNCTION_COUNT: usize = {};", functions.len());
    let _ = writeln!(out);
    let _ = writeln!(out, "/// Every driver function cudrv-sys knows, in table order.");
    let _ = writeln!(out, "pub static FUNCTIONS: [FunctionInfo; FUNCTION_COUNT] = [");
    for f in functions {
        let _ = writeln!(
            out,
            "    FunctionInfo {{ name: \"{}\", cname: c\"{}\", base: c\"{}\", versioned: {}, by_proc_address: {} }},",
            f.name,
            f.name,
            f.base_name(),
            f.base_name() != f.name,
            newest(f)
        );
    }
    let _ = writeln!(out, "];");
    let _ = writeln!(out);
    let _ = writeln!(out, "#[allow(non_snake_case, clippy::too_many_arguments, clippy::missing_safety_doc)]");
    let _ = writeln!(out, "impl Driver {{");
    for (i, f) in functions.iter().enumerate() {
        let params: Vec<String> = f.params.iter().map(|(n, t)| format!("{n}: {t}")).collect();
        let types: Vec<&str> = f.params.iter().map(|(_, t)| t.as_str()).collect();
        let names: Vec<&str> = f.params.iter().map(|(n, _)| n.as_str()).collect();
        let _ = writeln!(
            out,
            "    /// Calls the driver's `{}`, resolving it on first use.\n    ///\n    /// # Errors\n    /// [`MissingSymbol`] when this driver does not have the function.\n    ///\n    /// # Safety\n    /// The arguments must satisfy the driver API's contract for `{}`.",
            f.name,
            f.base_name()
        );
        let _ = writeln!(out, "    #[inline]");
        let _ = writeln!(
            out,
            "    pub unsafe fn {}(&self, {}) -> ::core::result::Result<{}, MissingSymbol> {{",
            f.name,
            params.join(", "),
            f.ret
        );
        let _ = writeln!(out, "        type __F = unsafe extern \"{}\" fn({}) -> {};", f.abi, types.join(", "), f.ret);
        let _ = writeln!(out, "        let __p = self.resolve({i})?;");
        let _ = writeln!(
            out,
            "        // SAFETY: `resolve` returned a non-null pointer to this exact symbol, with the ABI of\n        // the declaration bindgen generated it from (see `FunctionInfo::by_proc_address`).\n        let __f = unsafe {{ ::core::mem::transmute::<*mut ::core::ffi::c_void, __F>(__p) }};"
        );
        let _ = writeln!(
            out,
            "        // SAFETY: the caller upholds the driver's contract for the arguments.\n        Ok(unsafe {{ __f({}) }})",
            names.join(", ")
        );
        let _ = writeln!(out, "    }}\n");
    }
    let _ = writeln!(out, "}}");
    out
}

/// Older variants that `cuda.h` hides behind a `#define` of the base name to the newer one, with
/// the same signature: (the declared newer name, the older exported name). The newer ones arrived
/// in CUDA 12.8 and 11.4, so on older drivers only the older symbol exists; the safe crate falls
/// back to it.
const OLDER_VARIANTS: [(&str, &str); 2] =
    [("cuEventElapsedTime_v2", "cuEventElapsedTime"), ("cuDeviceGetUuid_v2", "cuDeviceGetUuid")];

/// `functions` plus a declaration of each [`OLDER_VARIANTS`] entry whose newer variant is declared
/// and whose older name is not. Such an older variant is resolved by its exact exported name (it
/// is not the newest of its base name), so the driver hands back the older ABI.
fn with_older_variants(functions: &[Function]) -> Vec<Function> {
    let mut all = functions.to_vec();
    for (newer, older) in OLDER_VARIANTS {
        if let Some(f) = functions.iter().find(|f| f.name == newer)
            && !functions.iter().any(|f| f.name == older)
        {
            all.push(Function { name: older.to_string(), ..f.clone() });
        }
    }
    all
}

fn version_of(name: &str) -> u32 {
    let base = base_name(name);
    if base.len() == name.len() { 1 } else { name[base.len() + 2..].parse().unwrap_or(1) }
}

/// Writes `result_name`, which maps a `CUresult` to its constant's name, from the
/// `pub const CUDA_...: cudaError_enum = cudaError_enum(N);` lines of the bindings.
pub fn generate_result_names(types: &str) -> String {
    let mut arms = String::new();
    let mut seen = std::collections::BTreeSet::new();
    // One item per `;`, whitespace removed: rustfmt wraps long constants over several lines.
    for item in types.split(';') {
        let item: String = item.split_whitespace().collect();
        let Some(at) = item.find("pubconstCUDA_") else { continue };
        let rest = &item[at + "pubconstCUDA_".len()..];
        let Some((name, value)) = rest.split_once(":cudaError_enum=cudaError_enum(") else { continue };
        let Some(value) = value.strip_suffix(')').map(|v| v.trim_end_matches(',')) else { continue };
        if let Ok(v) = value.parse::<u32>()
            && seen.insert(v)
        {
            let _ = writeln!(arms, "        {v} => Some(\"CUDA_{name}\"),");
        }
    }
    format!(
        "/// The name of a `CUresult` constant (`CUDA_ERROR_OUT_OF_MEMORY`), or `None` for a code the\n/// bindings do not know (a newer driver's).\npub fn result_name(code: CUresult) -> Option<&'static str> {{\n    match code.0 {{\n{arms}        _ => None,\n    }}\n}}\n"
    )
}
