//! Which hidden states a forward keeps for every position (the talker's input).

use std::fmt;
use std::str::FromStr;

use crate::error::ConfigError;
use crate::{Error, Result};

/// A point in the forward whose per-token hidden state can be captured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CaptureName {
    /// `hidden.<L>`: the residual stream entering layer `L`; `hidden.0` is the
    /// embeddings after the multimodal merge, `hidden.<num_layers>` the last
    /// layer's output before the final norm. With DeepStack items, `hidden.<L>`
    /// for `1 <= L <= levels` is layer `L - 1`'s output *before* its DeepStack
    /// add, as HF's `output_hidden_states` records it (a hook on the layer's output).
    Hidden(usize),
    /// `final`: the final-norm output (what `lm_head` reads).
    Final,
}

impl fmt::Display for CaptureName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaptureName::Hidden(l) => write!(f, "hidden.{l}"),
            CaptureName::Final => f.write_str("final"),
        }
    }
}

impl CaptureName {
    /// The name a captured point is written under where rows leave the engine (a
    /// safetensors file, a Python dict): `hidden.<L>`, or `hidden.final`, so every
    /// captured tensor shares the `hidden.` prefix.
    ///
    /// ```
    /// use omniprefix::model::CaptureName;
    /// assert_eq!(CaptureName::Hidden(2).key(), "hidden.2");
    /// assert_eq!(CaptureName::Final.key(), "hidden.final");
    /// ```
    pub fn key(self) -> String {
        match self {
            CaptureName::Hidden(layer) => format!("hidden.{layer}"),
            CaptureName::Final => "hidden.final".into(),
        }
    }

    /// Every point of a model with `num_layers` layers: each layer boundary and the final norm.
    pub fn every(num_layers: usize) -> Vec<CaptureName> {
        (0..=num_layers).map(CaptureName::Hidden).chain([CaptureName::Final]).collect()
    }

    /// A capture list as the command line and the Python options say it: `all`
    /// ([`CaptureName::every`]), or commas between points (see [`FromStr`]).
    ///
    /// ```
    /// use omniprefix::model::CaptureName;
    /// let points = CaptureName::parse_list("0, hidden.2,final", 4)?;
    /// assert_eq!(points, [CaptureName::Hidden(0), CaptureName::Hidden(2), CaptureName::Final]);
    /// assert_eq!(CaptureName::parse_list("all", 1)?.len(), 3);
    /// # Ok::<(), omniprefix::Error>(())
    /// ```
    pub fn parse_list(spec: &str, num_layers: usize) -> Result<Vec<CaptureName>> {
        if spec.trim() == "all" {
            return Ok(Self::every(num_layers));
        }
        spec.split(',').map(|part| part.trim().parse()).collect()
    }
}

impl FromStr for CaptureName {
    type Err = Error;

    /// Parses a layer number `L` or `hidden.<L>`, and `final` or `hidden.final`
    /// (the [`CaptureName::key`] form).
    fn from_str(s: &str) -> Result<Self> {
        if s == "final" || s == "hidden.final" {
            return Ok(CaptureName::Final);
        }
        s.strip_prefix("hidden.")
            .unwrap_or(s)
            .parse()
            .map(CaptureName::Hidden)
            .map_err(|_| ConfigError::CaptureSyntax { spec: s.into() }.into())
    }
}

/// The ordered, duplicate-free set of captured points; a point's index in
/// [`CaptureSpec::points`] is its slot in the hidden pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureSpec {
    points: Vec<CaptureName>,
}

impl CaptureSpec {
    /// Validates `points` against a model with `num_layers` layers (sorted, deduplicated).
    pub fn new(points: impl IntoIterator<Item = CaptureName>, num_layers: usize) -> Result<Self> {
        let mut points: Vec<CaptureName> = points.into_iter().collect();
        if let Some(&CaptureName::Hidden(layer)) =
            points.iter().find(|p| matches!(p, CaptureName::Hidden(l) if *l > num_layers))
        {
            return Err(ConfigError::CaptureLayer { layer, num_layers }.into());
        }
        points.sort();
        points.dedup();
        Ok(Self { points })
    }

    /// The default: `hidden.0`, `hidden.<num_layers/2>`, `final`.
    pub fn default_for(num_layers: usize) -> Self {
        let mut points =
            vec![CaptureName::Hidden(0), CaptureName::Hidden(num_layers / 2), CaptureName::Final];
        points.dedup();
        Self { points }
    }

    /// The captured points in page order.
    pub fn points(&self) -> &[CaptureName] {
        &self.points
    }

    /// The hidden-page slot of `name`, if captured.
    pub fn index_of(&self, name: CaptureName) -> Option<usize> {
        self.points.iter().position(|&p| p == name)
    }

    /// Number of captured points.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// True when nothing is captured.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sorts_and_rejects_layers_past_the_end() {
        let spec = CaptureSpec::new(
            ["final", "hidden.2", "hidden.0", "hidden.2"].iter().map(|s| s.parse().unwrap()),
            4,
        )
        .unwrap();
        assert_eq!(spec.points(), &[CaptureName::Hidden(0), CaptureName::Hidden(2), CaptureName::Final]);
        assert_eq!(spec.index_of(CaptureName::Final), Some(2));
        let err = CaptureSpec::new([CaptureName::Hidden(5)], 4).unwrap_err();
        assert!(matches!(err, Error::Config(ConfigError::CaptureLayer { layer: 5, num_layers: 4 })));
        assert!("hidden.x".parse::<CaptureName>().is_err());
        assert!("hidden.-1".parse::<CaptureName>().is_err());
        assert_eq!("3".parse::<CaptureName>().unwrap(), CaptureName::Hidden(3));
        assert_eq!("hidden.final".parse::<CaptureName>().unwrap(), CaptureName::Final);
        for name in CaptureName::every(3) {
            assert_eq!(name.key().parse::<CaptureName>().unwrap(), name, "{name}: the key parses back");
        }
        assert_eq!(CaptureName::Hidden(3).to_string(), "hidden.3");
    }
}
