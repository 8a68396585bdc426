// SPDX-License-Identifier: GPL-2.0
//! JSON through serde_json: `Json` is `serde_json::Value` (objects keep their insertion
//! order: feature `preserve_order`), plus the two builder methods the benchmarks use and
//! the one rule of our own, numbers rounded to six significant digits (so the results
//! files stay readable and diff well); non-finite numbers become null, as serde_json does.

pub use serde_json::Value as Json;

/// Builders on `Json` objects.
pub trait JsonExt: Sized {
    /// An empty object.
    fn obj() -> Self;
    /// Adds (or replaces) `key` of an object; a no-op on other values.
    fn set(&mut self, key: &str, v: impl Into<Json>) -> &mut Self;
    /// Builder form of [`JsonExt::set`].
    fn with(mut self, key: &str, v: impl Into<Json>) -> Self {
        self.set(key, v);
        self
    }
    /// [`JsonExt::with`] if `v` is something; the object unchanged (no null) if not.
    fn with_opt(self, key: &str, v: Option<impl Into<Json>>) -> Self {
        match v {
            Some(v) => self.with(key, v),
            None => self,
        }
    }
}

impl JsonExt for Json {
    fn obj() -> Json {
        Json::Object(serde_json::Map::new())
    }

    fn set(&mut self, key: &str, v: impl Into<Json>) -> &mut Json {
        if let Json::Object(m) = self {
            m.insert(key.to_string(), round(v.into()));
        }
        self
    }
}

/// `x` rounded to six significant digits, as a JSON number (null if not finite).
pub fn num(x: f64) -> Json {
    let r: f64 = format!("{x:.5e}").parse().unwrap_or(x);
    Json::from(r)
}

/// Rounds every float of `v` (integers stay exact).
fn round(v: Json) -> Json {
    match v {
        Json::Number(n) if n.is_f64() => n.as_f64().map_or(Json::Null, num),
        Json::Array(a) => Json::Array(a.into_iter().map(round).collect()),
        other => other,
    }
}

/// Checks that `s` is exactly one JSON value; returns serde_json's message if not.
pub fn validate(s: &str) -> Result<(), String> {
    serde_json::from_str::<serde::de::IgnoredAny>(s).map(|_| ()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_rounds_and_validates() {
        let j =
            Json::obj().with("a", 1u64).with("b", 2.0f64 / 3.0).with("c", f64::NAN).with("d", "x\"y").with("a", 5u64);
        assert_eq!(j.to_string(), r#"{"a":5,"b":0.666667,"c":null,"d":"x\"y"}"#);
        assert!(validate(&j.to_string()).is_ok());
        assert!(validate("{\"a\":1} x").is_err());
        assert!(validate("[1,]").is_err());
    }
}
