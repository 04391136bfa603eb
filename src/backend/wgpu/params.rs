//! The uniform parameters of the kernels, each declared once: [`wgsl_params!`] makes the
//! `#[repr(C)]` Pod struct the host uploads and its layout ([`ParamsLayout`]), from which
//! [`Shader::source`](crate::backend::wgpu::Shader::source) writes the WGSL struct and its
//! binding (`p`, binding 0) before the kernel. The kernel files only use `p`.

/// A type a params field may have: a 32-bit scalar, or an array of them.
pub(crate) trait WgslField {
    /// The WGSL scalar type of each word.
    const SCALAR: &'static str;
    /// Words of the field: 1 for a scalar, N for `[T; N]`.
    const WORDS: usize;
}

macro_rules! scalar_fields {
    ($($ty:ty),+) => {
        $(
            impl WgslField for $ty {
                const SCALAR: &'static str = stringify!($ty);
                const WORDS: usize = 1;
            }
        )+
    };
}
scalar_fields!(u32, i32, f32);

impl<const N: usize> WgslField for [u32; N] {
    const SCALAR: &'static str = "u32";
    const WORDS: usize = N;
}

/// One field of a params struct.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Field {
    pub(crate) name: &'static str,
    /// WGSL scalar type of each word (`u32`, `i32`, `f32`).
    pub(crate) scalar: &'static str,
    /// Words: an array field of N words is N scalars `name0 .. name{N-1}` in WGSL (an array
    /// in a uniform struct would need a 16-byte element stride).
    pub(crate) words: usize,
    /// Byte offset in the Rust struct.
    pub(crate) offset: usize,
}

/// A params struct's name, size and fields, as the Rust struct lays them out.
#[derive(Debug)]
pub(crate) struct ParamsLayout {
    pub(crate) name: &'static str,
    pub(crate) size: usize,
    pub(crate) fields: &'static [Field],
}

impl ParamsLayout {
    /// Panics (at compile time, from [`wgsl_params!`]) unless the fields are packed 32-bit
    /// words in declaration order, as the WGSL declaration lays them out, and the struct
    /// is a multiple of 16 bytes, as a WGSL uniform struct is.
    pub(crate) const fn check(&self) {
        let mut next = 0;
        let mut i = 0;
        while i < self.fields.len() {
            assert!(self.fields[i].offset == next, "params fields are packed 32-bit words");
            next += 4 * self.fields[i].words;
            i += 1;
        }
        assert!(next == self.size, "params are 32-bit words with no padding");
        assert!(self.size.is_multiple_of(16), "a WGSL uniform struct is a multiple of 16 bytes");
    }

    /// The WGSL declaration of the struct and of its uniform binding `p` (group 0, binding 0).
    pub(crate) fn wgsl(&self) -> String {
        let mut out = format!(
            "// {}: declared in Rust (wgsl_params!), bound as `p`.\nstruct {} {{\n",
            self.name, self.name
        );
        for field in self.fields {
            if field.words == 1 {
                out += &format!("    {}: {},\n", field.name, field.scalar);
            } else {
                for i in 0..field.words {
                    out += &format!("    {}{i}: {},\n", field.name, field.scalar);
                }
            }
        }
        out + &format!("}}\n\n@group(0) @binding(0) var<uniform> p: {};\n", self.name)
    }
}

/// A uniform params struct, declared once: emits the `#[repr(C)]` Pod struct and its
/// `LAYOUT` ([`ParamsLayout`]), from which the WGSL declaration is written. Fields are
/// 32-bit scalars (`u32`, `i32`, `f32`) or `[u32; N]` (N scalars in WGSL, see [`Field`]);
/// the struct must be a multiple of 16 bytes (WGSL uniform layout): checked at compile
/// time ([`ParamsLayout::check`]).
macro_rules! wgsl_params {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $($(#[$field_attr:meta])* $field_vis:vis $field:ident : $ty:ty),+ $(,)?
        }
    ) => {
        $(#[$attr])*
        #[repr(C)]
        #[derive(Clone, Copy, ::bytemuck::Pod, ::bytemuck::Zeroable)]
        $vis struct $name {
            $($(#[$field_attr])* $field_vis $field: $ty),+
        }

        impl $name {
            /// The layout the WGSL declaration is written from.
            pub(crate) const LAYOUT: $crate::backend::wgpu::params::ParamsLayout =
                $crate::backend::wgpu::params::ParamsLayout {
                    name: stringify!($name),
                    size: ::core::mem::size_of::<$name>(),
                    fields: &[$($crate::backend::wgpu::params::Field {
                        name: stringify!($field),
                        scalar: <$ty as $crate::backend::wgpu::params::WgslField>::SCALAR,
                        words: <$ty as $crate::backend::wgpu::params::WgslField>::WORDS,
                        offset: ::core::mem::offset_of!($name, $field),
                    }),+],
                };
        }

        const _: () = $name::LAYOUT.check();
    };
}
pub(crate) use wgsl_params;

#[cfg(test)]
mod tests {
    use crate::backend::wgpu::Shader;

    /// Every shader's params are a multiple of 16 bytes, and the WGSL written from them
    /// has the Rust struct's size and every field at its Rust offset (as naga lays it out).
    #[test]
    fn wgsl_declarations_match_the_rust_layout() {
        for shader in Shader::ALL {
            let layout = shader.params();
            assert!(layout.size.is_multiple_of(16), "{}: {} B", layout.name, layout.size);

            let source = layout.wgsl();
            let module = naga::front::wgsl::parse_str(&source)
                .unwrap_or_else(|e| panic!("{}: {}", layout.name, e.emit_to_string(&source)));
            let ty = module
                .types
                .iter()
                .map(|(_, t)| t)
                .find(|t| t.name.as_deref() == Some(layout.name))
                .expect("struct");
            let naga::TypeInner::Struct { members, span } = &ty.inner else {
                panic!("{}: not a struct", layout.name)
            };
            assert_eq!(*span as usize, layout.size, "{}: WGSL size", layout.name);
            let rust: Vec<(String, usize)> = layout
                .fields
                .iter()
                .flat_map(|f| {
                    (0..f.words).map(move |i| {
                        let name = if f.words == 1 { f.name.to_string() } else { format!("{}{i}", f.name) };
                        (name, f.offset + 4 * i)
                    })
                })
                .collect();
            let wgsl: Vec<(String, usize)> =
                members.iter().map(|m| (m.name.clone().unwrap_or_default(), m.offset as usize)).collect();
            assert_eq!(wgsl, rust, "{}: WGSL members and offsets", layout.name);
        }
    }
}
