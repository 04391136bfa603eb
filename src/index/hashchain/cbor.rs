//! A minimal CBOR encoder for exactly the shapes vLLM's block hash serialises.
//!
//! vLLM hashes `cbor2.dumps(obj, canonical=True)` of tuples of ints, bytes,
//! strings and `None`. For these shapes canonical CBOR is just the shortest
//! head encoding (RFC 8949 §4.2.1); no maps or floats are involved, so a few
//! functions writing into a reused buffer reproduce cbor2 byte for byte
//! without building a value tree.

/// CBOR major types used here.
const UNSIGNED: u8 = 0;
const NEGATIVE: u8 = 1;
const BYTES: u8 = 2;
const TEXT: u8 = 3;
const ARRAY: u8 = 4;
/// `None` / `null` (major 7, simple value 22).
const NULL: u8 = 0xf6;

/// Writes a head (major type + argument) in its shortest form.
fn head(out: &mut Vec<u8>, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        out.push(m | arg as u8);
    } else if let Ok(v) = u8::try_from(arg) {
        out.extend_from_slice(&[m | 24, v]);
    } else if let Ok(v) = u16::try_from(arg) {
        out.push(m | 25);
        out.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(arg) {
        out.push(m | 26);
        out.extend_from_slice(&v.to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&arg.to_be_bytes());
    }
}

/// A non-negative integer.
pub(crate) fn uint(out: &mut Vec<u8>, v: u64) {
    head(out, UNSIGNED, v);
}

/// A signed integer (negative ones as major type 1, argument `-1 - v`).
pub(crate) fn int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        head(out, UNSIGNED, v as u64);
    } else {
        // -1 - v cannot overflow for any negative i64.
        head(out, NEGATIVE, (-1 - v) as u64);
    }
}

/// A byte string.
pub(crate) fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    head(out, BYTES, b.len() as u64);
    out.extend_from_slice(b);
}

/// A UTF-8 text string.
pub(crate) fn text(out: &mut Vec<u8>, s: &str) {
    head(out, TEXT, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// The header of an array (Python tuple or list) of `len` items; the items follow.
pub(crate) fn array(out: &mut Vec<u8>, len: usize) {
    head(out, ARRAY, len as u64);
}

/// `None`.
pub(crate) fn null(out: &mut Vec<u8>) {
    out.push(NULL);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference encodings from RFC 8949 Appendix A (what cbor2 emits too).
    #[test]
    fn rfc8949_appendix_a_vectors() {
        let cases: &[(i64, &str)] = &[
            (0, "00"),
            (23, "17"),
            (24, "1818"),
            (100, "1864"),
            (1000, "1903e8"),
            (1_000_000, "1a000f4240"),
            (1_000_000_000_000, "1b000000e8d4a51000"),
            (-1, "20"),
            (-10, "29"),
            (-100, "3863"),
            (-1000, "3903e7"),
            (i64::MIN, "3b7fffffffffffffff"),
        ];
        for &(v, want) in cases {
            let mut out = Vec::new();
            int(&mut out, v);
            assert_eq!(hex::encode(&out), want, "int {v}");
        }
        let mut out = Vec::new();
        uint(&mut out, u64::MAX);
        assert_eq!(hex::encode(&out), "1bffffffffffffffff");
    }

    #[test]
    fn strings_arrays_and_null() {
        let mut out = Vec::new();
        array(&mut out, 3);
        text(&mut out, "a");
        bytes(&mut out, &[1, 2, 3, 4]);
        null(&mut out);
        assert_eq!(hex::encode(&out), "8361614401020304f6");
        let mut long = Vec::new();
        text(&mut long, &"x".repeat(24));
        assert_eq!(&long[..2], &[0x78, 24]);
        let mut arr = Vec::new();
        array(&mut arr, 25);
        assert_eq!(arr, [0x98, 25]);
    }
}
