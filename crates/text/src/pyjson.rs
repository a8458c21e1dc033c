//! Python `json.dumps` output format on top of `serde_json`'s serializer.
//!
//! transformers' chat-template `tojson` is
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`:
//! items separated by `", "`, keys by `": "`, non-ASCII kept, no HTML escaping, key order
//! kept, floats written as Python's `repr(float)`. Only the layout and float spelling differ
//! from `serde_json`, so this is a [`serde_json::ser::Formatter`].

use std::io::{self, Write};

use serde::Serialize;
use serde_json::ser::Formatter;

/// Options of Python's `json.dumps` that change the output text.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    /// `ensure_ascii`: escape every non-ASCII char as `\uXXXX` (UTF-16 surrogate pairs).
    pub ensure_ascii: bool,
    /// `indent` as the per-level string (`indent=2` → `"  "`); `None` keeps one line.
    pub indent: Option<String>,
    /// `separators` (item, key); defaults depend on `indent` as in Python.
    pub separators: Option<(String, String)>,
    /// `sort_keys`.
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    /// transformers' chat-template defaults.
    fn default() -> Self {
        DumpOptions {
            ensure_ascii: false,
            indent: None,
            separators: None,
            sort_keys: false,
        }
    }
}

/// Serialises `value` as Python's `json.dumps(value, **opts)` would.
pub(crate) fn dumps<T: Serialize + ?Sized>(
    value: &T,
    opts: &DumpOptions,
) -> Result<String, String> {
    let mut json = serde_json::to_value(value).map_err(|e| e.to_string())?;
    if opts.sort_keys {
        sort_keys(&mut json);
    }
    let (item_sep, key_sep) = match (&opts.separators, &opts.indent) {
        (Some((i, k)), _) => (i.clone(), k.clone()),
        (None, None) => (", ".to_string(), ": ".to_string()),
        (None, Some(_)) => (",".to_string(), ": ".to_string()),
    };
    let fmt = PyFormatter {
        item_sep,
        key_sep,
        indent: opts.indent.clone(),
        ensure_ascii: opts.ensure_ascii,
        level: 0,
        has_value: false,
    };
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    json.serialize(&mut ser).map_err(|e| e.to_string())?;
    String::from_utf8(out).map_err(|e| e.to_string())
}

fn sort_keys(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            map.sort_keys();
            map.values_mut().for_each(sort_keys);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(sort_keys),
        _ => {}
    }
}

/// Python's `repr(float)` (`float_repr_style == 'short'`), plus `json.dumps`' spelling of
/// non-finite values: shortest round-trip digits; positional notation when the decimal
/// exponent is in -4 < decpt <= 16 (always with a fractional part, `1.0`), else
/// `d.ddde±XX` with at least two exponent digits (`1e-05`, `1e+16`).
pub(crate) fn py_float_repr(v: f64) -> String {
    if v.is_nan() {
        return "NaN".to_string();
    }
    if v.is_infinite() {
        return if v > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    // Rust's `{:e}` without precision prints the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{v:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let exp: i32 = exp.parse().unwrap_or(0);
    let decpt = exp + 1; // position of the decimal point after the first digit
    let ndigits = digits.len() as i32;
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-decpt) as usize));
            out.push_str(&digits);
        } else if decpt >= ndigits {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', (decpt - ndigits) as usize));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt as usize]);
            out.push('.');
            out.push_str(&digits[decpt as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if ndigits > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        out.push_str(&format!("{:02}", exp.unsigned_abs()));
    }
    out
}

struct PyFormatter {
    item_sep: String,
    key_sep: String,
    indent: Option<String>,
    ensure_ascii: bool,
    level: usize,
    has_value: bool,
}

impl PyFormatter {
    fn newline_indent<W: ?Sized + Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(indent) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(indent.as_bytes())?;
            }
        }
        Ok(())
    }

    fn begin<W: ?Sized + Write>(&mut self, w: &mut W, open: &[u8]) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(open)
    }

    fn end<W: ?Sized + Write>(&mut self, w: &mut W, close: &[u8]) -> io::Result<()> {
        self.level = self.level.saturating_sub(1);
        if self.has_value {
            self.newline_indent(w)?;
        }
        w.write_all(close)
    }

    fn item<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(self.item_sep.as_bytes())?;
        }
        self.newline_indent(w)
    }
}

impl Formatter for PyFormatter {
    fn write_f32<W: ?Sized + Write>(&mut self, w: &mut W, value: f32) -> io::Result<()> {
        // Python has only doubles; widen through the shortest decimal form of the f32.
        let v: f64 = value.to_string().parse().unwrap_or(f64::from(value));
        w.write_all(py_float_repr(v).as_bytes())
    }

    fn write_f64<W: ?Sized + Write>(&mut self, w: &mut W, value: f64) -> io::Result<()> {
        w.write_all(py_float_repr(value).as_bytes())
    }

    fn write_string_fragment<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        if !self.ensure_ascii {
            return w.write_all(fragment.as_bytes());
        }
        for c in fragment.chars() {
            if (' '..='~').contains(&c) {
                w.write_all(&[c as u8])?;
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(w, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }

    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.begin(w, b"[")
    }

    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.end(w, b"]")
    }

    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }

    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.begin(w, b"{")
    }

    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.end(w, b"}")
    }

    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }

    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(self.key_sep.as_bytes())
    }

    fn end_object_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_like_python_repr() {
        // Expected strings are CPython's repr(float).
        let cases: &[(f64, &str)] = &[
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (2.5, "2.5"),
            (-3.25, "-3.25"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1.5e-4, "0.00015"),
            (1e-5, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (1e15, "1000000000000000.0"),
            (1234567890123456.0, "1234567890123456.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e100, "1e+100"),
            (123.456, "123.456"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "Infinity"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (v, want) in cases {
            assert_eq!(py_float_repr(*v), *want, "{v:e}");
        }
    }

    #[test]
    fn default_layout_matches_python() {
        let v = json!({"b": 1, "a": [1, 2.0, {"x": null}], "s": "Zürich <&> \"q\"\n\u{1}", "e": {}, "l": []});
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            "{\"b\": 1, \"a\": [1, 2.0, {\"x\": null}], \"s\": \"Zürich <&> \\\"q\\\"\\n\\u0001\", \"e\": {}, \"l\": []}"
        );
    }

    #[test]
    fn indent_sort_ascii_like_python() {
        let v = json!({"b": [1, []], "a": "é😀"});
        let opts = DumpOptions {
            ensure_ascii: true,
            indent: Some("  ".into()),
            separators: None,
            sort_keys: true,
        };
        // json.dumps(v, ensure_ascii=True, indent=2, sort_keys=True)
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            "{\n  \"a\": \"\\u00e9\\ud83d\\ude00\",\n  \"b\": [\n    1,\n    []\n  ]\n}"
        );
        let compact = DumpOptions {
            separators: Some((",".into(), ":".into())),
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&json!([1, {"k": 2}]), &compact).unwrap(),
            "[1,{\"k\":2}]"
        );
    }
}
