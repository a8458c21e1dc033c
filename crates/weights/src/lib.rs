//! Hugging Face safetensors snapshots, memory-mapped.
//!
//! A snapshot folder holds either one `model.safetensors` or several shards listed in
//! `model.safetensors.index.json` (`weight_map`: tensor name → shard file). Every shard is
//! memory-mapped once; a [`Tensor`] is a typed view into its shard's mapping, so opening a
//! 70 GB checkpoint costs page-table entries, not RAM. Parsing of the safetensors header is done
//! by the `safetensors` crate.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;

/// Element type of a stored tensor (the subset of safetensors dtypes this model uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// 32-bit unsigned words (packed quantized weights).
    U32,
    /// 32-bit signed integers.
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::U32 | DType::I32 => 4,
        }
    }

    /// Whether the dtype is a float format that upcasts exactly to f32.
    pub fn is_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F32)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
            DType::U32 => "U32",
            DType::I32 => "I32",
        };
        f.write_str(s)
    }
}

/// Why a snapshot or one of its tensors cannot be used. Each variant names the file and, where
/// one is involved, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be opened or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The folder has neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("no weights in {dir}: expected model.safetensors or model.safetensors.index.json")]
    NoWeights {
        /// The snapshot folder.
        dir: PathBuf,
    },
    /// The shard index is malformed.
    #[error("{path}: {reason}")]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A shard named by the index does not exist.
    #[error("shard {shard} (listed in {index}) is missing")]
    MissingShard {
        /// The missing shard's path.
        shard: PathBuf,
        /// The index that names it.
        index: PathBuf,
    },
    /// A safetensors file is truncated or its header is invalid.
    #[error("{path} is not a valid safetensors file: {reason}")]
    BadFile {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        reason: String,
    },
    /// A tensor the model needs is absent.
    #[error("tensor `{tensor}` is missing (looked in {where_})")]
    MissingTensor {
        /// The tensor name.
        tensor: String,
        /// Where it was expected: the shard the index assigns it to, or the files searched.
        where_: String,
    },
    /// A tensor has the wrong shape.
    #[error("tensor `{tensor}` in {file} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The tensor name.
        tensor: String,
        /// Its file.
        file: PathBuf,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The stored shape.
        found: Vec<usize>,
    },
    /// A tensor has a dtype this path cannot use.
    #[error("tensor `{tensor}` in {file} has dtype {found}, expected {expected}")]
    DTypeMismatch {
        /// The tensor name.
        tensor: String,
        /// Its file.
        file: PathBuf,
        /// Acceptable dtypes, in words.
        expected: String,
        /// The stored dtype (safetensors name).
        found: String,
    },
    /// The same tensor name appears in two files.
    #[error("tensor `{tensor}` appears in both {first} and {second}")]
    Duplicate {
        /// The tensor name.
        tensor: String,
        /// First file.
        first: PathBuf,
        /// Second file.
        second: PathBuf,
    },
}

/// A typed view of one stored tensor inside a memory-mapped shard.
#[derive(Clone)]
pub struct Tensor {
    name: Arc<str>,
    file: Arc<Path>,
    map: Arc<Mmap>,
    /// Byte range of the data inside `map`.
    start: usize,
    end: usize,
    dtype: Result<DType, String>,
    shape: Vec<usize>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("file", &self.file)
            .finish()
    }
}

impl Tensor {
    /// The stored name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The shard it lives in.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Stored shape, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The raw bytes, little-endian as safetensors stores them.
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.end]
    }

    /// The stored dtype.
    ///
    /// # Errors
    /// [`LoadError::DTypeMismatch`] for dtypes this crate does not model (e.g. F64, I8).
    pub fn dtype(&self) -> Result<DType, LoadError> {
        self.dtype.clone().map_err(|found| LoadError::DTypeMismatch {
            tensor: self.name.to_string(),
            file: self.file.to_path_buf(),
            expected: "BF16, F16, F32, U32 or I32".into(),
            found,
        })
    }

    /// Checks the shape, naming the tensor and file on mismatch.
    ///
    /// # Errors
    /// [`LoadError::ShapeMismatch`].
    pub fn expect_shape(&self, expected: &[usize]) -> Result<&Self, LoadError> {
        if self.shape != expected {
            return Err(LoadError::ShapeMismatch {
                tensor: self.name.to_string(),
                file: self.file.to_path_buf(),
                expected: expected.to_vec(),
                found: self.shape.clone(),
            });
        }
        Ok(self)
    }

    /// Checks that the dtype is a float format (BF16, F16 or F32).
    ///
    /// # Errors
    /// [`LoadError::DTypeMismatch`].
    pub fn expect_float(&self) -> Result<DType, LoadError> {
        let dt = self.dtype()?;
        if !dt.is_float() {
            return Err(LoadError::DTypeMismatch {
                tensor: self.name.to_string(),
                file: self.file.to_path_buf(),
                expected: "BF16, F16 or F32".into(),
                found: dt.to_string(),
            });
        }
        Ok(dt)
    }

    /// Converts elements `[offset, offset + out.len())` of a float tensor to f32 (exact for
    /// BF16/F16). Panics if the range is out of bounds or the dtype is not a float: callers
    /// validate with [`Tensor::expect_float`] and [`Tensor::expect_shape`] at load time.
    pub fn read_f32(&self, offset: usize, out: &mut [f32]) {
        let dt = self.dtype.as_ref().expect("dtype validated at load");
        let b = self.bytes();
        let n = out.len();
        match dt {
            DType::BF16 => {
                let src = &b[offset * 2..(offset + n) * 2];
                for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            DType::F16 => {
                let src = &b[offset * 2..(offset + n) * 2];
                for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            DType::F32 => {
                let src = &b[offset * 4..(offset + n) * 4];
                for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            other => panic!("read_f32 on non-float tensor {} ({other})", self.name),
        }
    }

    /// The whole float tensor as f32.
    ///
    /// # Errors
    /// [`LoadError::DTypeMismatch`] when it is not a float tensor.
    pub fn to_f32(&self) -> Result<Vec<f32>, LoadError> {
        self.expect_float()?;
        let mut v = vec![0.0; self.numel()];
        self.read_f32(0, &mut v);
        Ok(v)
    }
}

fn map_dtype(d: safetensors::Dtype) -> Result<DType, String> {
    use safetensors::Dtype as S;
    match d {
        S::BF16 => Ok(DType::BF16),
        S::F16 => Ok(DType::F16),
        S::F32 => Ok(DType::F32),
        S::U32 => Ok(DType::U32),
        S::I32 => Ok(DType::I32),
        other => Err(format!("{other:?}")),
    }
}

/// All tensors of a snapshot folder, by name.
pub struct Snapshot {
    dir: PathBuf,
    tensors: HashMap<String, Tensor>,
    /// For sharded snapshots: the shard the index assigns to each name (used in error messages).
    index: Option<(PathBuf, BTreeMap<String, String>)>,
}

impl fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshot").field("dir", &self.dir).field("tensors", &self.tensors.len()).finish()
    }
}

impl Snapshot {
    /// Opens `model.safetensors`, or every shard of `model.safetensors.index.json`, in `dir`.
    ///
    /// # Errors
    /// [`LoadError`] naming the file: missing or unreadable shard, truncated file, bad header,
    /// an index that names a tensor its shard does not hold, duplicate tensor names.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut tensors = HashMap::new();
        let mut index = None;
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|source| LoadError::Io { path: index_path.clone(), source })?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| LoadError::BadIndex {
                path: index_path.clone(),
                reason: format!("not valid JSON: {e}"),
            })?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| LoadError::BadIndex {
                path: index_path.clone(),
                reason: "`weight_map` is missing or not an object".into(),
            })?;
            let mut weight_map = BTreeMap::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| LoadError::BadIndex {
                    path: index_path.clone(),
                    reason: format!("`weight_map.{name}` is not a file name"),
                })?;
                if file.contains('/') || file.contains('\\') || file == ".." {
                    return Err(LoadError::BadIndex {
                        path: index_path.clone(),
                        reason: format!("`weight_map.{name}` names a file outside the folder: {file}"),
                    });
                }
                weight_map.insert(name.clone(), file.to_string());
            }
            let mut shards: Vec<&String> = weight_map.values().collect();
            shards.sort();
            shards.dedup();
            for shard in shards {
                let path = dir.join(shard);
                if !path.exists() {
                    return Err(LoadError::MissingShard { shard: path, index: index_path.clone() });
                }
                add_file(&path, &mut tensors)?;
            }
            for (name, file) in &weight_map {
                if !tensors.contains_key(name) {
                    return Err(LoadError::MissingTensor {
                        tensor: name.clone(),
                        where_: format!("{} (as {} says)", dir.join(file).display(), index_path.display()),
                    });
                }
            }
            index = Some((index_path, weight_map));
        } else if single.exists() {
            add_file(&single, &mut tensors)?;
        } else {
            return Err(LoadError::NoWeights { dir: dir.to_path_buf() });
        }
        Ok(Snapshot { dir: dir.to_path_buf(), tensors, index })
    }

    /// The snapshot folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Names of all tensors, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(|s| s.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// A tensor by name.
    ///
    /// # Errors
    /// [`LoadError::MissingTensor`] naming the tensor and the file(s) it was looked for in.
    pub fn get(&self, name: &str) -> Result<&Tensor, LoadError> {
        self.tensors.get(name).ok_or_else(|| LoadError::MissingTensor {
            tensor: name.to_string(),
            where_: match &self.index {
                Some((idx, _)) => format!("every shard listed in {}", idx.display()),
                None => self.dir.join("model.safetensors").display().to_string(),
            },
        })
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|t| (t.end - t.start) as u64).sum()
    }
}

fn add_file(path: &Path, tensors: &mut HashMap<String, Tensor>) -> Result<(), LoadError> {
    let file = std::fs::File::open(path).map_err(|source| LoadError::Io { path: path.to_path_buf(), source })?;
    // SAFETY: the mapping is read-only; a checkpoint changed on disk while mapped is outside
    // what any engine can defend against (llama.cpp and safetensors make the same assumption).
    let map = unsafe { Mmap::map(&file) }.map_err(|source| LoadError::Io { path: path.to_path_buf(), source })?;
    let bad = |reason: String| LoadError::BadFile { path: path.to_path_buf(), reason };
    // `deserialize` validates the header and that every tensor lies inside the file.
    safetensors::SafeTensors::deserialize(&map).map_err(|e| bad(e.to_string()))?;
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| bad(e.to_string()))?;
    let data_start = 8 + header_len;
    let map = Arc::new(map);
    let file_arc: Arc<Path> = Arc::from(path);
    for (name, info) in meta.tensors() {
        let (s, e) = info.data_offsets;
        let start = data_start + s;
        let end = data_start + e;
        if end > map.len() {
            return Err(bad(format!("tensor `{name}` runs past the end of the file")));
        }
        let t = Tensor {
            name: Arc::from(name.as_str()),
            file: file_arc.clone(),
            map: map.clone(),
            start,
            end,
            dtype: map_dtype(info.dtype),
            shape: info.shape.clone(),
        };
        if let Ok(dt) = &t.dtype {
            if t.numel() * dt.size_bytes() != end - start {
                return Err(bad(format!("tensor `{name}`: byte length does not match shape {:?}", t.shape)));
            }
        }
        if let Some(prev) = tensors.get(&name) {
            return Err(LoadError::Duplicate {
                tensor: name.clone(),
                first: prev.file.to_path_buf(),
                second: path.to_path_buf(),
            });
        }
        tensors.insert(name.clone(), t);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(path: &Path, tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    fn bf16_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()).collect()
    }

    #[test]
    fn single_file_and_dtypes() {
        let d = tempfile::tempdir().unwrap();
        let f16b: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes()).collect();
        let f32b: Vec<u8> = [0.25f32, 7.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        write(
            &d.path().join("model.safetensors"),
            &[
                ("a", safetensors::Dtype::BF16, vec![2], bf16_bytes(&[1.0, -0.5])),
                ("b", safetensors::Dtype::F16, vec![2], f16b),
                ("c", safetensors::Dtype::F32, vec![1, 2], f32b),
            ],
        );
        let s = Snapshot::open(d.path()).unwrap();
        assert_eq!(s.get("a").unwrap().to_f32().unwrap(), vec![1.0, -0.5]);
        assert_eq!(s.get("b").unwrap().to_f32().unwrap(), vec![1.5, -2.0]);
        assert_eq!(s.get("c").unwrap().to_f32().unwrap(), vec![0.25, 7.0]);
        let err = s.get("c").unwrap().expect_shape(&[2]).unwrap_err().to_string();
        assert!(err.contains("`c`") && err.contains("[1, 2]"), "{err}");
        let err = s.get("zzz").unwrap_err().to_string();
        assert!(err.contains("`zzz`") && err.contains("model.safetensors"), "{err}");
    }

    #[test]
    fn sharded_missing_shard_and_truncation() {
        let d = tempfile::tempdir().unwrap();
        write(&d.path().join("s1.safetensors"), &[("x", safetensors::Dtype::BF16, vec![2], bf16_bytes(&[1.0, 2.0]))]);
        write(&d.path().join("s2.safetensors"), &[("y", safetensors::Dtype::BF16, vec![1], bf16_bytes(&[3.0]))]);
        let idx = serde_json::json!({"metadata": {}, "weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}});
        std::fs::write(d.path().join("model.safetensors.index.json"), idx.to_string()).unwrap();
        let s = Snapshot::open(d.path()).unwrap();
        assert_eq!(s.get("y").unwrap().to_f32().unwrap(), vec![3.0]);
        assert_eq!(s.names(), vec!["x", "y"]);

        // Truncate a shard: the error names the file.
        let p = d.path().join("s2.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 1]).unwrap();
        let err = Snapshot::open(d.path()).unwrap_err().to_string();
        assert!(err.contains("s2.safetensors"), "{err}");

        // Remove a shard.
        std::fs::remove_file(&p).unwrap();
        let err = Snapshot::open(d.path()).unwrap_err().to_string();
        assert!(err.contains("s2.safetensors") && err.contains("missing"), "{err}");
    }

    #[test]
    fn empty_folder() {
        let d = tempfile::tempdir().unwrap();
        let err = Snapshot::open(d.path()).unwrap_err().to_string();
        assert!(err.contains("no weights"), "{err}");
    }
}
