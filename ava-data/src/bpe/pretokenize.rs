//! GPT-2's split of text into pre-tokens, the `tokenizers` crate's `ByteLevel` pre-tokenizer
//! with `use_regex`: the pattern
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
//! scanned by hand (one pass, no backtracking), with the Unicode classes of the regex engine
//! the crate uses.
//!
//! One difference, on purpose: built with `fancy-regex` (as here), the crate stops splitting
//! where the regex exceeds its backtracking limit, a run of about a million whitespace chars
//! before a non-space, and leaves the rest of the text one pre-token; we split it as the
//! pattern says, as the Python `tokenizers` package (Oniguruma) does.

use std::sync::OnceLock;

/// Chars in none of the classes below (punctuation, symbols, marks, controls).
pub(crate) const OTHER: u8 = 0;
/// `\p{L}`: general category Letter.
pub(crate) const LETTER: u8 = 1;
/// `\p{N}`: general category Number.
pub(crate) const NUMBER: u8 = 2;
/// `\s`: the White_Space property.
pub(crate) const SPACE: u8 = 3;

/// Code points per block of the two-level table.
const BLOCK_BITS: u32 = 7;
const BLOCK: usize = 1 << BLOCK_BITS;
const CODE_POINTS: usize = 0x11_0000;

/// Each code point's class, in deduplicated blocks (about 80 KB instead of 1.1 MB).
pub(crate) struct Classes {
    /// Block number of each run of `BLOCK` code points.
    index: Box<[u16]>,
    /// The blocks, one after another.
    table: Box<[u8]>,
    /// The classes of ASCII, looked up first.
    ascii: [u8; 128],
}

/// The classes, built once per process.
pub(crate) fn classes() -> &'static Classes {
    static CLASSES: OnceLock<Classes> = OnceLock::new();
    CLASSES.get_or_init(Classes::build)
}

/// The ranges of a Unicode class as `regex-syntax` (under the `regex` crate that
/// `fancy-regex` delegates classes to) defines it, so that ours are the crate's exactly.
fn ranges(pattern: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let hir = regex_syntax::parse(pattern).unwrap_or_else(|e| panic!("regex-syntax rejects {pattern}: {e}"));
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => {
            class.ranges().iter().map(|r| (u32::from(r.start()), u32::from(r.end()))).collect()
        }
        other => panic!("{pattern} is not a Unicode class: {other:?}"),
    }
}

impl Classes {
    fn build() -> Self {
        let mut flat = vec![OTHER; CODE_POINTS];
        for (pattern, class) in [(r"\p{L}", LETTER), (r"\p{N}", NUMBER), (r"\s", SPACE)] {
            for (start, end) in ranges(pattern) {
                flat[start as usize..=end as usize].fill(class);
            }
        }
        let mut index = Vec::with_capacity(CODE_POINTS / BLOCK);
        let mut table: Vec<u8> = Vec::new();
        let mut seen: std::collections::HashMap<&[u8], u16> = std::collections::HashMap::new();
        for block in flat.chunks(BLOCK) {
            let next = seen.len();
            let number = *seen.entry(block).or_insert_with(|| {
                table.extend_from_slice(block);
                u16::try_from(next).expect("fewer than 2^16 distinct blocks")
            });
            index.push(number);
        }
        let mut ascii = [OTHER; 128];
        ascii.copy_from_slice(&flat[..128]);
        Self { index: index.into_boxed_slice(), table: table.into_boxed_slice(), ascii }
    }

    /// The class of code point `c`.
    #[inline]
    pub(crate) fn of(&self, c: u32) -> u8 {
        let block = self.index[(c >> BLOCK_BITS) as usize] as usize;
        self.table[(block << BLOCK_BITS) | (c as usize & (BLOCK - 1))]
    }

    /// The class and UTF-8 length of the char starting at byte `i` of `s` (valid UTF-8).
    #[inline]
    fn at(&self, s: &[u8], i: usize) -> (u8, usize) {
        let b = s[i];
        if b < 0x80 {
            return (self.ascii[b as usize], 1);
        }
        let cont = |k: usize| u32::from(s[i + k] & 0x3f);
        let (c, len) = if b < 0xe0 {
            ((u32::from(b & 0x1f) << 6) | cont(1), 2)
        } else if b < 0xf0 {
            ((u32::from(b & 0x0f) << 12) | (cont(1) << 6) | cont(2), 3)
        } else {
            ((u32::from(b & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3), 4)
        };
        (self.of(c), len)
    }

    /// End of the run of chars of `class` that starts at `i`.
    #[inline]
    fn run_end(&self, s: &[u8], mut i: usize, class: u8) -> usize {
        while i < s.len() {
            let b = s[i];
            if b < 0x80 {
                if self.ascii[b as usize] != class {
                    break;
                }
                i += 1;
            } else {
                let (c, len) = self.at(s, i);
                if c != class {
                    break;
                }
                i += len;
            }
        }
        i
    }

    /// End of the pre-token that starts at byte `i` of `s` (`i < s.len()`).
    #[inline]
    fn token_end(&self, s: &[u8], i: usize) -> usize {
        let b = s[i];
        if b == b'\'' {
            // The contractions come first in the pattern, and are ASCII lowercase only.
            match (s.get(i + 1), s.get(i + 2)) {
                (Some(b's' | b't' | b'm' | b'd'), _) => return i + 2,
                (Some(b'r'), Some(b'e')) | (Some(b'v'), Some(b'e')) | (Some(b'l'), Some(b'l')) => return i + 3,
                _ => {}
            }
        }
        let (class, len) = self.at(s, i);
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: one U+0020 may lead a run.
        if b == b' ' && i + 1 < s.len() {
            let (next, _) = self.at(s, i + 1);
            if next != SPACE {
                return self.run_end(s, i + 1, next);
            }
        }
        if class != SPACE {
            return self.run_end(s, i + len, class);
        }
        // `\s+(?!\S)`: a run of whitespace before a non-space leaves its last char to the
        // next pre-token (where a last U+0020 leads the word); `\s+`: a lone one is its own.
        let (mut end, mut last) = (i + len, i);
        while end < s.len() {
            let (c, len) = self.at(s, end);
            if c != SPACE {
                break;
            }
            last = end;
            end += len;
        }
        if end == s.len() || last == i { end } else { last }
    }
}

/// The pre-tokens of `text`, in order, as byte ranges that cover it.
pub(crate) struct PreTokens<'a> {
    text: &'a [u8],
    at: usize,
    classes: &'a Classes,
}

impl<'a> PreTokens<'a> {
    pub(crate) fn new(text: &'a str, classes: &'a Classes) -> Self {
        Self { text: text.as_bytes(), at: 0, classes }
    }
}

impl<'a> Iterator for PreTokens<'a> {
    type Item = &'a [u8];

    #[inline]
    fn next(&mut self) -> Option<&'a [u8]> {
        if self.at >= self.text.len() {
            return None;
        }
        let start = self.at;
        self.at = self.classes.token_end(self.text, start);
        Some(&self.text[start..self.at])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        let mut at = 0;
        for token in PreTokens::new(text, classes()) {
            out.push(&text[at..at + token.len()]);
            at += token.len();
        }
        out
    }

    #[test]
    fn the_classes_are_the_unicode_ones_and_disjoint() {
        let c = classes();
        for (ch, class) in [
            ('a', LETTER),
            ('Z', LETTER),
            ('é', LETTER),
            ('東', LETTER),
            ('ʰ', LETTER),
            ('7', NUMBER),
            ('١', NUMBER),
            ('Ⅻ', NUMBER),
            ('½', NUMBER),
            (' ', SPACE),
            ('\t', SPACE),
            ('\u{0b}', SPACE),
            ('\u{85}', SPACE),
            ('\u{a0}', SPACE),
            ('\u{3000}', SPACE),
            ('\u{2028}', SPACE),
            ('\'', OTHER),
            ('\u{301}', OTHER),
            ('\u{200d}', OTHER),
            ('😀', OTHER),
            ('_', OTHER),
            ('\u{10ffff}', OTHER),
        ] {
            assert_eq!(c.of(u32::from(ch)), class, "{ch:?}");
        }
        // A char in two classes would make the scanner's single class per char wrong.
        let letters = ranges(r"\p{L}");
        for (class, pattern) in [(NUMBER, r"\p{N}"), (SPACE, r"\s")] {
            for (start, end) in ranges(pattern) {
                for cp in start..=end {
                    assert_eq!(c.of(cp), class, "U+{cp:04X}");
                    assert!(!letters.iter().any(|&(a, b)| (a..=b).contains(&cp)), "U+{cp:04X}");
                }
            }
        }
    }

    #[test]
    fn gpt2_splits() {
        assert_eq!(split("Hello world"), ["Hello", " world"]);
        assert_eq!(split("it's They'LL we're I'M"), ["it", "'s", " They", "'", "LL", " we", "'re", " I", "'", "M"]);
        assert_eq!(split("IT'S it's"), ["IT", "'", "S", " it", "'s"]);
        assert_eq!(split("a  b"), ["a", " ", " b"]);
        assert_eq!(split("a \n\n b\n"), ["a", " \n\n", " b", "\n"]);
        assert_eq!(split("x\n\ny"), ["x", "\n", "\n", "y"]);
        assert_eq!(split("  "), ["  "]);
        assert_eq!(split(" 's"), [" '", "s"]);
        assert_eq!(split("abc123 456!?  ..."), ["abc", "123", " 456", "!?", " ", " ..."]);
        assert_eq!(split("naïve 東京 ١٢٣"), ["naïve", " 東京", " ١٢٣"]);
        assert_eq!(split(""), Vec::<&str>::new());
        let spaces = " ".repeat(1 << 20);
        assert_eq!(split(&format!("{spaces}x")), [&spaces[1..], " x"]);
    }

    /// The crate's `ByteLevel` pre-tokenizer (its regex) and ours cut `text` at the same places.
    fn assert_splits_as_the_crate(text: &str) {
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let mut pre = PreTokenizedString::from(text);
        ByteLevel::new(false, false, true).pre_tokenize(&mut pre).unwrap();
        let want: Vec<(usize, usize)> =
            pre.get_splits(OffsetReferential::Original, OffsetType::Byte).into_iter().map(|(_, o, _)| o).collect();
        let mut got = Vec::new();
        for token in PreTokens::new(text, classes()) {
            let at = got.last().map_or(0, |&(_, end)| end);
            got.push((at, at + token.len()));
        }
        assert_eq!(got, want, "{text:?}: {:?}", split(text));
    }

    #[test]
    fn it_splits_as_the_crates_regex() {
        const PIECES: &[&str] = &[
            "a",
            "S",
            "s",
            "t",
            "re",
            "ve",
            "m",
            "ll",
            "d",
            "D",
            "LL",
            "RE",
            "x",
            " ",
            " ",
            "\n",
            "\t",
            "\r",
            "\u{b}",
            "'",
            "'",
            "’",
            "0",
            "42",
            "é",
            "東",
            "١",
            "Ⅻ",
            "½",
            "\u{301}",
            "😀",
            "\u{200d}",
            "\u{a0}",
            "\u{3000}",
            "\u{85}",
            "\u{2028}",
            "\u{1680}",
            "!",
            ".",
            "_",
            "<|endoftext|>",
            "  ",
            "\r\n",
        ];
        let mut rng = crate::Rng::new(8);
        for _ in 0..5000 {
            let len = rng.below(24) as usize;
            let text: String = (0..len).map(|_| PIECES[rng.below(PIECES.len() as u64) as usize]).collect();
            assert_splits_as_the_crate(&text);
        }
        // A sample of every part of Unicode, between letters, digits, spaces and symbols.
        for cp in (0..0x11_0000u32).step_by(37) {
            let Some(c) = char::from_u32(cp) else { continue };
            assert_splits_as_the_crate(&format!("a{c}b {c}{c}1{c} {c}'s{c}!{c}\n{c} "));
        }
    }
}
