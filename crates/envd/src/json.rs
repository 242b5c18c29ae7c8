//! proto3-JSON helpers shared by the message modules.
//!
//! The proto3 JSON mapping differs from what serde derives by default in a few places that the
//! E2B SDKs depend on: bytes travel as base64, 64-bit integers as strings, enums as their names,
//! and default values are left out. Decoders must be lenient in the other direction (numbers for
//! int64, strings for int32, either base64 alphabet, enum numbers), so each helper here accepts
//! every spelling the mapping allows.

use std::fmt;

use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use base64::engine::DecodePaddingMode;
use base64::{alphabet, Engine as _};
use bytes::Bytes;
use serde::de::{self, Deserializer, Visitor};
use serde::Serializer;

/// `true` when `v` equals the type's default; proto3 JSON omits such fields.
pub(crate) fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

const LENIENT: GeneralPurposeConfig = GeneralPurposeConfig::new()
    .with_encode_padding(true)
    .with_decode_padding_mode(DecodePaddingMode::Indifferent)
    .with_decode_allow_trailing_bits(true);
const STANDARD_LENIENT: GeneralPurpose = GeneralPurpose::new(&alphabet::STANDARD, LENIENT);
const URL_SAFE_LENIENT: GeneralPurpose = GeneralPurpose::new(&alphabet::URL_SAFE, LENIENT);

/// Decodes base64 in either alphabet, padded or not, as the proto3 JSON mapping requires.
pub fn decode_base64(s: &str) -> Result<Vec<u8>, base64::DecodeError> {
    if s.contains(['-', '_']) {
        URL_SAFE_LENIENT.decode(s)
    } else {
        STANDARD_LENIENT.decode(s)
    }
}

/// Encodes bytes as padded standard base64 (what protobuf JSON encoders emit).
pub fn encode_base64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// `bytes` fields wrapped in `Option` (oneof members and optional fields).
pub(crate) mod opt_b64 {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<Bytes>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_str(&encode_base64(b)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Bytes>, D::Error> {
        let s: Option<String> = serde::Deserialize::deserialize(d)?;
        match s {
            None => Ok(None),
            Some(s) => decode_base64(&s)
                .map(|v| Some(Bytes::from(v)))
                .map_err(|e| de::Error::custom(format!("invalid base64: {e}"))),
        }
    }
}

/// Visitor for integers that also accepts their decimal string form.
struct IntVisitor<T>(std::marker::PhantomData<T>);

impl<T> Visitor<'_> for IntVisitor<T>
where
    T: TryFrom<i64> + TryFrom<u64> + std::str::FromStr,
{
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an integer or a decimal string")
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        T::try_from(v).map_err(|_| E::custom(format!("integer {v} out of range")))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        T::try_from(v).map_err(|_| E::custom(format!("integer {v} out of range")))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
        // JSON numbers like `3.0` are valid integer spellings in proto3 JSON.
        if v.fract() == 0.0 && v.abs() < 9.007_199_254_740_992e15 {
            self.visit_i64(v as i64)
        } else {
            Err(E::custom(format!("{v} is not an integer")))
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        v.trim()
            .parse::<T>()
            .map_err(|_| E::custom(format!("invalid integer string {v:?}")))
    }
}

fn deserialize_int<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64> + std::str::FromStr + Default,
{
    d.deserialize_any(OptIntVisitor::<T>(std::marker::PhantomData))
        .map(Option::unwrap_or_default)
}

/// Like [`IntVisitor`], but `null` means "unset".
struct OptIntVisitor<T>(std::marker::PhantomData<T>);

impl<'de, T> Visitor<'de> for OptIntVisitor<T>
where
    T: TryFrom<i64> + TryFrom<u64> + std::str::FromStr,
{
    type Value = Option<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an integer, a decimal string or null")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<T>, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Option<T>, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<T>, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Option<T>, E> {
        IntVisitor(std::marker::PhantomData).visit_i64(v).map(Some)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Option<T>, E> {
        IntVisitor(std::marker::PhantomData).visit_u64(v).map(Some)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Option<T>, E> {
        IntVisitor(std::marker::PhantomData).visit_f64(v).map(Some)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<T>, E> {
        IntVisitor(std::marker::PhantomData).visit_str(v).map(Some)
    }
}

/// 32-bit integers: numbers on output, numbers or strings on input.
pub(crate) mod int32 {
    use super::*;

    pub fn deserialize<'de, D, T>(d: D) -> Result<T, D::Error>
    where
        D: Deserializer<'de>,
        T: TryFrom<i64> + TryFrom<u64> + std::str::FromStr + Default,
    {
        deserialize_int(d)
    }
}

/// Optional `uint32` (oneof members).
pub(crate) mod opt_u32 {
    use super::*;

    pub fn serialize<S: Serializer>(v: &Option<u32>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(n) => s.serialize_u32(*n),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        d.deserialize_any(OptIntVisitor::<u32>(std::marker::PhantomData))
    }
}

/// `int64`: a decimal string on output, a string or a number on input.
pub(crate) mod int64 {
    use super::*;

    pub fn serialize<S: Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        deserialize_int(d)
    }
}

/// Defines a proto3 enum: JSON names on output; names or numbers on input. Unknown numbers are
/// kept (proto3 enums are open); unknown names decode as the zero value, as a decoder that
/// ignores unknown fields does.
macro_rules! proto_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $num:literal => $json:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
            /// A value this version does not know, kept by number.
            Unknown(i32),
        }

        impl $name {
            /// The protobuf number of this value.
            pub fn number(self) -> i32 {
                match self {
                    $( Self::$variant => $num, )+
                    Self::Unknown(n) => n,
                }
            }

            /// The value for a protobuf number (unknown numbers are kept).
            pub fn from_number(n: i32) -> Self {
                match n {
                    $( $num => Self::$variant, )+
                    n => Self::Unknown(n),
                }
            }

            /// The proto3 JSON name, or `None` for an unknown value.
            pub fn name(self) -> Option<&'static str> {
                match self {
                    $( Self::$variant => Some($json), )+
                    Self::Unknown(_) => None,
                }
            }

            /// The value with this proto3 JSON name.
            pub fn from_name(s: &str) -> Option<Self> {
                match s {
                    $( $json => Some(Self::$variant), )+
                    _ => None,
                }
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::from_number(0)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                match self.name() {
                    Some(name) => s.serialize_str(name),
                    None => s.serialize_i32(self.number()),
                }
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> serde::de::Visitor<'de> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str(concat!("a ", stringify!($name), " name or number"))
                    }
                    fn visit_unit<E: serde::de::Error>(self) -> Result<$name, E> {
                        Ok($name::default())
                    }
                    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<$name, E> {
                        Ok($name::from_name(v).unwrap_or_default())
                    }
                    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<$name, E> {
                        i32::try_from(v)
                            .map($name::from_number)
                            .map_err(|_| E::custom("enum number out of range"))
                    }
                    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<$name, E> {
                        i32::try_from(v)
                            .map($name::from_number)
                            .map_err(|_| E::custom("enum number out of range"))
                    }
                }
                d.deserialize_any(V)
            }
        }
    };
}
pub(crate) use proto_enum;

/// Defines a message that consists of one oneof (or a oneof type used as a field), as a Rust
/// enum. On the wire it is an object with exactly one member set, e.g. `{"stdout":"aGkK"}`.
/// Decoding goes through a struct of optional fields so that unknown members and `null`s are
/// ignored the way proto3 JSON decoders ignore them.
macro_rules! oneof {
    (
        $(#[$meta:meta])*
        pub enum $name:ident ($oneof:literal) via $repr:ident {
            $( $(#[doc = $doc:literal])* $variant:ident($ty:ty) => $field:ident $([$($fattr:tt)*])?, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        #[allow(clippy::large_enum_variant)] // transient wire messages, never stored in bulk
        pub enum $name {
            $( $(#[doc = $doc])* $variant($ty), )+
        }

        #[derive(Default, serde::Serialize, serde::Deserialize)]
        #[serde(default)]
        struct $repr {
            $(
                #[serde(skip_serializing_if = "Option::is_none")]
                $( #[serde($($fattr)*)] )?
                $field: Option<$ty>,
            )+
        }

        impl From<$name> for $repr {
            fn from(v: $name) -> Self {
                match v {
                    $( $name::$variant(x) => $repr { $field: Some(x), ..Default::default() }, )+
                }
            }
        }

        impl TryFrom<$repr> for $name {
            type Error = String;
            fn try_from(r: $repr) -> Result<Self, String> {
                let mut found = None;
                let mut count = 0usize;
                $(
                    if let Some(x) = r.$field {
                        count += 1;
                        found = Some($name::$variant(x));
                    }
                )+
                if count > 1 {
                    return Err(format!(concat!("more than one member of oneof `", $oneof, "` is set ({})"), count));
                }
                found.ok_or_else(|| concat!("no member of oneof `", $oneof, "` is set").to_string())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                $repr::from(self.clone()).serialize(s)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let r = <$repr as serde::Deserialize>::deserialize(d)?;
                $name::try_from(r).map_err(serde::de::Error::custom)
            }
        }
    };
}
pub(crate) use oneof;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_accepts_both_alphabets_and_missing_padding() {
        assert_eq!(decode_base64("aGkK").unwrap(), b"hi\n");
        assert_eq!(decode_base64("aGk").unwrap(), b"hi");
        assert_eq!(decode_base64("-_8=").unwrap(), vec![0xfb, 0xff]);
        assert_eq!(decode_base64("+/8").unwrap(), vec![0xfb, 0xff]);
        assert!(decode_base64("!!").is_err());
    }
}
