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
    /// An older ABI declared by cudrv-sys itself: always resolved by its exported name, never
    /// through `cuGetProcAddress` (which would hand back the newest ABI of its base name).
    pub older: bool,
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

/// What [`read`] takes out of bindgen's output.
pub struct Bindings {
    /// The bindings without `extern` blocks: types, constants, impls.
    pub types: String,
    /// The declared functions.
    pub functions: Vec<Function>,
    /// `(name, value)` of every `CUresult` constant (`CUDA_ERROR_OUT_OF_MEMORY`, 2).
    pub results: Vec<(String, u32)>,
}

/// Reads bindgen's output with `syn`: the functions declared in `extern` blocks, the `CUresult`
/// constants, and the rest, pretty-printed again without the `extern` blocks.
pub fn read(bindings: &str) -> Result<Bindings, String> {
    let mut file = syn::parse_file(bindings).map_err(|e| format!("the bindings do not parse: {e}"))?;
    let mut functions = Vec::new();
    let mut results = Vec::new();
    let mut kept = Vec::with_capacity(file.items.len());
    for item in std::mem::take(&mut file.items) {
        match item {
            syn::Item::ForeignMod(block) => {
                let abi = block.abi.name.as_ref().map_or_else(|| "C".to_string(), syn::LitStr::value);
                for foreign in block.items {
                    match foreign {
                        syn::ForeignItem::Fn(f) => functions.push(function(&f.sig, &abi)?),
                        other => return Err(format!("unexpected item in an extern block: {}", tokens(&other))),
                    }
                }
            }
            item => {
                if let syn::Item::Impl(block) = &item {
                    results.extend(result_constants(block));
                }
                kept.push(item);
            }
        }
    }
    if functions.is_empty() {
        return Err("no extern function declarations found in the bindings".into());
    }
    file.items = kept;
    let types = prettyplease::unparse(&file);
    Ok(Bindings { types, functions, results })
}

fn tokens(t: &impl quote::ToTokens) -> String {
    t.to_token_stream().to_string()
}

/// A declared function: its name, parameters and return type, as Rust source.
fn function(sig: &syn::Signature, abi: &str) -> Result<Function, String> {
    let name = sig.ident.to_string();
    if sig.variadic.is_some() {
        return Err(format!("variadic driver function {name} is not supported"));
    }
    let mut params = Vec::new();
    for (i, input) in sig.inputs.iter().enumerate() {
        let syn::FnArg::Typed(arg) = input else { return Err(format!("{name} takes self")) };
        let pname = match &*arg.pat {
            syn::Pat::Ident(p) => p.ident.to_string(),
            _ => format!("arg{i}"),
        };
        params.push((pname, normalize(&tokens(&*arg.ty))));
    }
    let ret = match &sig.output {
        syn::ReturnType::Default => "()".to_string(),
        syn::ReturnType::Type(_, ty) => normalize(&tokens(&**ty)),
    };
    Ok(Function { name, abi: abi.to_string(), params, ret, older: false })
}

/// The `CUresult` constants of an `impl cudaError_enum` block: `pub const CUDA_X: cudaError_enum
/// = cudaError_enum(N);`.
fn result_constants(block: &syn::ItemImpl) -> Vec<(String, u32)> {
    let is_result = matches!(&*block.self_ty, syn::Type::Path(p) if p.path.is_ident("cudaError_enum"));
    if !is_result {
        return Vec::new();
    }
    block
        .items
        .iter()
        .filter_map(|item| {
            let syn::ImplItem::Const(c) = item else { return None };
            let syn::Expr::Call(call) = &c.expr else { return None };
            let Some(syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(v), .. })) = call.args.first() else {
                return None;
            };
            Some((c.ident.to_string(), v.base10_parse().ok()?))
        })
        .collect()
}

/// `* mut CUdeviceptr` → `*mut CUdeviceptr`: the token printer's spacing, tidied.
fn normalize(ty: &str) -> String {
    ty.split_whitespace().collect::<Vec<_>>().join(" ").replace("* mut ", "*mut ").replace("* const ", "*const ")
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
            newest(f) && !f.older
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

/// Older variants of entry points that `cuda.h` declares only in a newer variant (or, for
/// `cuGraphInstantiate`, maps to its successor `cuGraphInstantiateWithFlags`), so that the safe
/// crate can fall back to them on the drivers that lack the newer ones: the UUID and event-timing
/// calls (same signature; newer ones in CUDA 11.4 and 12.8), the stream-capture and graph entry
/// points that changed after CUDA 11.1, and the managed-memory hints that changed in 12.2. The
/// kernel-node parameters of the older variants are a prefix of the newer struct.
const OLDER_DECLARATIONS: &str = r#"extern "C" {
    pub fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult;
    pub fn cuEventElapsedTime(pMilliseconds: *mut f32, hStart: CUevent, hEnd: CUevent) -> CUresult;
    pub fn cuStreamGetCaptureInfo(hStream: CUstream, captureStatus_out: *mut CUstreamCaptureStatus, id_out: *mut cuuint64_t) -> CUresult;
    pub fn cuStreamGetCaptureInfo_v2(hStream: CUstream, captureStatus_out: *mut CUstreamCaptureStatus, id_out: *mut cuuint64_t, graph_out: *mut CUgraph, dependencies_out: *mut *const CUgraphNode, numDependencies_out: *mut usize) -> CUresult;
    pub fn cuGraphInstantiate_v2(phGraphExec: *mut CUgraphExec, hGraph: CUgraph, phErrorNode: *mut CUgraphNode, logBuffer: *mut ::std::os::raw::c_char, bufferSize: usize) -> CUresult;
    pub fn cuGraphExecUpdate(hGraphExec: CUgraphExec, hGraph: CUgraph, hErrorNode_out: *mut CUgraphNode, updateResult_out: *mut CUgraphExecUpdateResult) -> CUresult;
    pub fn cuGraphAddKernelNode(phGraphNode: *mut CUgraphNode, hGraph: CUgraph, dependencies: *const CUgraphNode, numDependencies: usize, nodeParams: *const CUDA_KERNEL_NODE_PARAMS) -> CUresult;
    pub fn cuGraphExecKernelNodeSetParams(hGraphExec: CUgraphExec, hNode: CUgraphNode, nodeParams: *const CUDA_KERNEL_NODE_PARAMS) -> CUresult;
    pub fn cuMemPrefetchAsync(devPtr: CUdeviceptr, count: usize, dstDevice: CUdevice, hStream: CUstream) -> CUresult;
    pub fn cuMemAdvise(devPtr: CUdeviceptr, count: usize, advice: CUmem_advise, device: CUdevice) -> CUresult;
}"#;

/// `functions` plus a declaration of each [`OLDER_DECLARATIONS`] entry that the bindings do not
/// declare, of a base name they declare in a newer variant only (or not at all). Such an older
/// variant is resolved by its exact exported name (it is not the newest of its base name), so the
/// driver hands back the older ABI.
fn with_older_variants(functions: &[Function]) -> Vec<Function> {
    let mut all = functions.to_vec();
    let older = read_declarations(OLDER_DECLARATIONS).expect("the older declarations are valid Rust");
    for f in older {
        // Not declared by the bindings, which declare a newer variant, or (cuGraphInstantiate,
        // which cuda.h maps to cuGraphInstantiateWithFlags) none under the base name.
        let newer_declared =
            functions.iter().any(|g| g.base_name() == f.base_name() && version_of(&g.name) > version_of(&f.name));
        let base_declared = functions.iter().any(|g| g.base_name() == f.base_name());
        if (newer_declared || !base_declared) && !all.iter().any(|g| g.name == f.name) {
            all.push(Function { older: true, ..f });
        }
    }
    all
}

/// The functions declared in `extern` blocks of `source`.
fn read_declarations(source: &str) -> Result<Vec<Function>, String> {
    let file = syn::parse_file(source).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for item in file.items {
        if let syn::Item::ForeignMod(block) = item {
            let abi = block.abi.name.as_ref().map_or_else(|| "C".to_string(), syn::LitStr::value);
            for foreign in block.items {
                if let syn::ForeignItem::Fn(f) = foreign {
                    out.push(function(&f.sig, &abi)?);
                }
            }
        }
    }
    Ok(out)
}

fn version_of(name: &str) -> u32 {
    let base = base_name(name);
    if base.len() == name.len() { 1 } else { name[base.len() + 2..].parse().unwrap_or(1) }
}

/// Writes `result_name`, which maps a `CUresult` to its constant's name (the first, where names
/// share a value).
pub fn generate_result_names(results: &[(String, u32)]) -> String {
    let mut arms = String::new();
    let mut seen = std::collections::BTreeSet::new();
    for (name, v) in results {
        if seen.insert(*v) {
            let _ = writeln!(arms, "        {v} => Some(\"{name}\"),");
        }
    }
    format!(
        "/// The name of a `CUresult` constant (`CUDA_ERROR_OUT_OF_MEMORY`), or `None` for a code the\n/// bindings do not know (a newer driver's).\npub fn result_name(code: CUresult) -> Option<&'static str> {{\n    match code.0 {{\n{arms}        _ => None,\n    }}\n}}\n"
    )
}
