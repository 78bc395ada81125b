//! Finding a tokenizer's added tokens (`<|endoftext|>`, ...) in text as the `tokenizers`
//! crate does: the tokens not marked `normalized` first, then the others in the text between
//! (with no normalizer both match the text as it is); each time the leftmost match, the
//! longest of those starting there. The text between is pre-tokenized piece by piece.

use aho_corasick::{AhoCorasick, AhoCorasickKind, Input, MatchKind};

use super::load::Unsupported;

/// Leftmost-longest matching of a set of strings, by an Aho–Corasick automaton: time linear
/// in the text however many tokens there are (a tokenizer.json may list tens of thousands
/// sharing a first byte, `<|reserved_...|>`).
#[derive(Default)]
struct Matcher {
    /// `None`: no tokens.
    automaton: Option<AhoCorasick>,
    /// Each pattern's id.
    ids: Vec<u32>,
}

impl Matcher {
    fn new<'a>(tokens: impl Iterator<Item = (&'a str, u32)>) -> Result<Self, Unsupported> {
        let (contents, ids): (Vec<&str>, Vec<u32>) = tokens.unzip();
        if contents.is_empty() {
            return Ok(Self::default());
        }
        // A contiguous NFA builds in time linear in the tokens' bytes (the DFA that would be
        // picked for few tokens takes far longer on a long one).
        let automaton = AhoCorasick::builder()
            .kind(Some(AhoCorasickKind::ContiguousNFA))
            .match_kind(MatchKind::LeftmostLongest)
            .build(&contents)
            .map_err(|e| Unsupported(format!("its added tokens do not make a matcher ({e})")))?;
        Ok(Self { automaton: Some(automaton), ids })
    }

    /// The leftmost-longest match at or after `from`: start, end, id.
    fn find(&self, s: &[u8], from: usize) -> Option<(usize, usize, u32)> {
        let m = self.automaton.as_ref()?.find(Input::new(s).range(from..))?;
        Some((m.start(), m.end(), self.ids[m.pattern().as_usize()]))
    }
}

/// What text splits into.
pub(crate) enum Piece<'a> {
    /// Text between added tokens (never empty).
    Text(&'a str),
    /// An added token's id.
    Token(u32),
}

/// A tokenizer's added tokens.
#[derive(Default)]
pub(crate) struct AddedTokens {
    /// Those not `normalized`, matched first.
    raw: Matcher,
    /// The `normalized` ones, matched in the text between.
    normalized: Matcher,
}

impl AddedTokens {
    /// From each token's content (not empty), id, and `normalized` flag.
    pub(crate) fn new(tokens: &[(String, u32, bool)]) -> Result<Self, Unsupported> {
        let pick = |normalized: bool| {
            Matcher::new(tokens.iter().filter(move |t| t.2 == normalized).map(|(c, id, _)| (c.as_str(), *id)))
        };
        Ok(Self { raw: pick(false)?, normalized: pick(true)? })
    }

    /// Calls `f` with the pieces of `text`, in order.
    pub(crate) fn split<'a>(&self, text: &'a str, f: &mut impl FnMut(Piece<'a>)) {
        Self::split_with(&self.raw, text, &mut |piece| match piece {
            Piece::Text(between) => Self::split_with(&self.normalized, between, f),
            token => f(token),
        });
    }

    fn split_with<'a>(matcher: &Matcher, text: &'a str, f: &mut impl FnMut(Piece<'a>)) {
        let s = text.as_bytes();
        let mut at = 0;
        while let Some((start, end, id)) = matcher.find(s, at) {
            if start > at {
                f(Piece::Text(&text[at..start]));
            }
            f(Piece::Token(id));
            at = end;
        }
        if at < text.len() {
            f(Piece::Text(&text[at..]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(added: &AddedTokens, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        added.split(text, &mut |p| {
            out.push(match p {
                Piece::Text(t) => t.to_string(),
                Piece::Token(id) => format!("#{id}"),
            })
        });
        out
    }

    #[test]
    fn leftmost_longest_raw_first() {
        let added = AddedTokens::new(&[
            ("<a>".into(), 1, false),
            ("<a><b>".into(), 2, false),
            ("<b>".into(), 3, true),
            ("b>x".into(), 4, false),
        ])
        .unwrap();
        assert_eq!(pieces(&added, "x<a><b>y<a>z"), ["x", "#2", "y", "#1", "z"]);
        // "b>x" (not normalized) is taken before "<b>" is looked for in what is left.
        assert_eq!(pieces(&added, "<b>x<b>"), ["<", "#4", "#3"]);
        assert_eq!(pieces(&added, "<a"), ["<a"]);
        assert_eq!(pieces(&added, ""), Vec::<String>::new());
        assert_eq!(pieces(&AddedTokens::default(), "abc"), ["abc"]);
        let many = AddedTokens::new(&[
            ("é".into(), 1, false),
            ("x".into(), 2, false),
            ("y".into(), 3, false),
            ("z".into(), 4, false),
        ])
        .unwrap();
        assert_eq!(pieces(&many, "aébyc"), ["a", "#1", "b", "#3", "c"]);
    }
}
