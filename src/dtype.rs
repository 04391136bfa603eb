//! The one element type of the crate: of an item's content tensor (which is
//! fingerprinted, so every type counts) and of stored weights and K/V pages
//! (which only the float types may be).
//!
//! Where only a float precision makes sense (`--dtype`, `--kv-dtype`, the
//! Python `dtype=` / `kv_dtype=`, [`EngineConfig`](crate::engine::EngineConfig)),
//! the boundary rejects an integer type with a typed error:
//! [`Dtype::parse_float`] for text, [`Dtype::is_float`] for values.

use std::fmt;
use std::str::FromStr;

/// An element type, named as the CLI, the Python package and the reports name it.
///
/// ```
/// use omniprefix::Dtype;
/// assert_eq!("bf16".parse::<Dtype>(), Ok(Dtype::Bf16));
/// assert_eq!(Dtype::F16.to_string(), "f16");
/// assert_eq!(Dtype::Bf16.size_bytes(), 2);
/// assert!(!Dtype::U8.is_float());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    U8,
    I32,
    I64,
    F16,
    Bf16,
    F32,
}

/// What the float-only parsers name as accepted (`auto` is [`Dtype::parse_or_auto`]'s).
const FLOAT_EXPECTED: &str = "auto, f32, bf16 or f16";

impl Dtype {
    /// Every dtype, in the order of their canonical header tags.
    pub const ALL: [Dtype; 6] = [Dtype::U8, Dtype::I32, Dtype::I64, Dtype::F16, Dtype::Bf16, Dtype::F32];

    /// Bytes of one element.
    pub const fn size_bytes(self) -> usize {
        match self {
            Dtype::U8 => 1,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::I32 | Dtype::F32 => 4,
            Dtype::I64 => 8,
        }
    }

    /// Whether weights and K/V pages may be stored in this type.
    pub const fn is_float(self) -> bool {
        matches!(self, Dtype::F16 | Dtype::Bf16 | Dtype::F32)
    }

    /// The name the CLI, the Python package and the reports use.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::U8 => "u8",
            Dtype::I32 => "i32",
            Dtype::I64 => "i64",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
        }
    }

    /// A float dtype name, as `--kv-dtype` takes it; an integer name is
    /// refused like an unknown one.
    ///
    /// ```
    /// use omniprefix::Dtype;
    /// assert_eq!(Dtype::parse_float("f16"), Ok(Dtype::F16));
    /// assert!(Dtype::parse_float("u8").is_err());
    /// ```
    pub fn parse_float(s: &str) -> Result<Dtype, UnknownDtype> {
        match s.parse::<Dtype>() {
            Ok(d) if d.is_float() => Ok(d),
            _ => Err(UnknownDtype { found: s.to_string(), expected: FLOAT_EXPECTED }),
        }
    }

    /// `auto` (`None`: the checkpoint's own dtype) or a float dtype name, as
    /// `--dtype` and the Python package's `dtype=` take it.
    ///
    /// ```
    /// use omniprefix::Dtype;
    /// assert_eq!(Dtype::parse_or_auto("auto"), Ok(None));
    /// assert_eq!(Dtype::parse_or_auto("f16"), Ok(Some(Dtype::F16)));
    /// assert!(Dtype::parse_or_auto("fp8").is_err());
    /// assert!(Dtype::parse_or_auto("i32").is_err());
    /// ```
    pub fn parse_or_auto(s: &str) -> Result<Option<Dtype>, UnknownDtype> {
        if s == "auto" { Ok(None) } else { Dtype::parse_float(s).map(Some) }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A dtype name outside the set a parser accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("dtype `{found}`: expected {expected}")]
pub struct UnknownDtype {
    /// The name given.
    pub found: String,
    /// The names accepted, as a phrase.
    pub expected: &'static str,
}

impl FromStr for Dtype {
    type Err = UnknownDtype;
    /// Any of the six names; see [`Dtype::parse_float`] for the float-only boundary.
    fn from_str(s: &str) -> Result<Self, UnknownDtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| UnknownDtype { found: s.to_string(), expected: "u8, i32, i64, f16, bf16 or f32" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_serde_agrees() {
        for d in Dtype::ALL {
            assert_eq!(d.to_string().parse::<Dtype>(), Ok(d));
            assert_eq!(serde_json::to_string(&d).unwrap(), format!("\"{d}\""));
        }
        assert_eq!(Dtype::ALL.map(Dtype::size_bytes), [1, 4, 8, 2, 2, 4]);
        assert_eq!(Dtype::ALL.map(Dtype::is_float), [false, false, false, true, true, true]);
    }

    #[test]
    fn float_parsers_refuse_integers_with_the_float_message() {
        for name in ["u8", "i32", "i64", "fp8"] {
            let err = Dtype::parse_float(name).unwrap_err();
            assert_eq!(err, UnknownDtype { found: name.into(), expected: FLOAT_EXPECTED });
            assert_eq!(err.to_string(), format!("dtype `{name}`: expected auto, f32, bf16 or f16"));
            assert_eq!(Dtype::parse_or_auto(name), Err(err));
        }
        assert_eq!(
            "fp8".parse::<Dtype>().unwrap_err().to_string(),
            "dtype `fp8`: expected u8, i32, i64, f16, bf16 or f32"
        );
    }
}
