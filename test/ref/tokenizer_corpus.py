#!/usr/bin/env python3
"""The tokenizer test corpus: a deterministic list of (name, text) cases.

test/ref/tokenizer_reference.py runs Hugging Face `tokenizers` on these texts and commits the texts with the
reference ids in test/ref/data/tokenizer_reference.jsonl; the C++ test reads only that file, so this script
never runs in CI. Everything random here comes from random.Random with a fixed seed and uses no table that
depends on the Python version (unicodedata differs between Pythons), so any Python 3 gives the same corpus.

    python3 test/ref/tokenizer_corpus.py          prints a summary (cases, characters, bytes)
"""
import random

# ---- 1. Natural text: at least 20 languages and scripts ---------------------------------------------------
LANGUAGES = {
    "english": "The quick brown fox jumps over the lazy dog. It wasn't me, I'd say; they'll see.",
    "german": "Größenwahn ist keine Lösung: Über die Brücke fahren täglich 12.000 Autos.",
    "french": "L'été dernier, nous sommes allés à Besançon ; c'était très agréable, n'est-ce pas ?",
    "spanish": "¿Dónde está la biblioteca? ¡Mañana llegará el niño con su pingüino!",
    "portuguese": "A ação da coração não é fácil; vovô comeu pão e maçã às três horas.",
    "italian": "Perché l'università è così lontana? Più tardi andrò là con Niccolò.",
    "polish": "Zażółć gęślą jaźń. Pchnąć w tę łódź jeża lub ośm skrzyń fig.",
    "turkish": "İstanbul'da ılık bir akşam; Çağrı ve Şükrü göğe baktılar.",
    "vietnamese": "Tiếng Việt có dấu: Người ta thường nói rằng học, học nữa, học mãi.",
    "czech": "Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "russian": "Съешь же ещё этих мягких французских булок, да выпей чаю. Ёлка!",
    "ukrainian": "Їжак ґалантно цілує і обіймає щасливу ящірку; «Слава» — з’їв.",
    "greek": "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Καλημέρα, κόσμε!",
    "arabic": "مرحبا بالعالم! هذه جملة عربية للاختبار، مع أرقام ١٢٣ وعلامات.",
    "persian": "سلام دنیا؛ این یک جمله فارسی است با اعداد ۱۲۳۴ و نیم‌فاصله.",
    "hebrew": "שלום עולם! זהו משפט בעברית, עם ניקוד: בְּרֵאשִׁית בָּרָא.",
    "hindi": "नमस्ते दुनिया! यह हिंदी का एक वाक्य है, अंक १२३ के साथ। क़लम ज़रूर।",
    "bengali": "আমি বাংলায় গান গাই। সংখ্যা ১২৩ এবং কৌতূহল।",
    "tamil": "வணக்கம் உலகம்! தமிழ் ஒரு பழமையான மொழி. கொ கோ கௌ",
    "telugu": "నమస్కారం ప్రపంచం! తెలుగు భాష చాలా అందమైనది.",
    "kannada": "ನಮಸ್ಕಾರ ಜಗತ್ತು! ಕನ್ನಡ ಒಂದು ಸುಂದರ ಭಾಷೆ. ಕೈ ಕೊ",
    "malayalam": "നമസ്കാരം ലോകം! മലയാളം ഒരു ദ്രാവിഡ ഭാഷയാണ്. കൊ കോ കൌ",
    "gujarati": "નમસ્તે દુનિયા! ગુજરાતી ભાષા.",
    "punjabi": "ਸਤ ਸ੍ਰੀ ਅਕਾਲ ਦੁਨੀਆ! ਪੰਜਾਬੀ ਭਾਸ਼ਾ।",
    "sinhala": "ආයුබෝවන් ලෝකය! සිංහල භාෂාව. කො කෝ",
    "thai": "สวัสดีชาวโลก ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ ๑๒๓",
    "lao": "ສະບາຍດີໂລກ ພາສາລາວ ໑໒໓",
    "khmer": "សួស្តីពិភពលោក ភាសាខ្មែរ ១២៣",
    "myanmar": "မင်္ဂလာပါကမ္ဘာ မြန်မာဘာသာ ၁၂၃",
    "tibetan": "བཀྲ་ཤིས་བདེ་ལེགས། བོད་ཡིག ༡༢༣",
    "chinese_simplified": "你好，世界！这是一个用于测试分词器的中文句子，包含标点符号。",
    "chinese_traditional": "這是繁體中文的句子：「歡迎光臨」，請多指教。",
    "japanese": "こんにちは世界！カタカナとひらがな、漢字を混ぜた文です。ｶﾀｶﾅ（半角）も。",
    "korean": "안녕하세요 세계! 한국어 문장입니다. 숫자 123과 함께.",
    "georgian": "გამარჯობა მსოფლიო! ქართული ენა.",
    "armenian": "Բարեւ աշխարհ։ Հայերեն լեզու։",
    "amharic": "ሰላም ልዑል! አማርኛ ቋንቋ ነው። ፩፪፫",
    "mongolian": "ᠮᠣᠩᠭᠣᠯ ᠪᠢᠴᠢᠭ᠌ Монгол хэл",
    "cherokee": "ᏣᎳᎩ ᎦᏬᏂᎯᏍᏗ ᎠᏂᏴᏫ",
    "inuktitut": "ᐃᓄᒃᑎᑐᑦ ᑎᑎᕋᐅᓯᖅ",
    "yoruba": "Ẹ kú àárọ̀! Ọmọ mi ń lọ sí ilé-ìwé.",
    "mixed": "English, 中文, русский, العربية, हिन्दी and 日本語 in one line.",
}

# ---- 2. Source code ---------------------------------------------------------------------------------------
CODE = {
    "c": '#include <stdio.h>\n\nint main(int argc, char** argv) {\n\tfor (int i = 0; i < argc; i++) {\n'
         '\t\tprintf("%d: %s\\n", i, argv[i]);\n\t}\n\treturn 0;\n}\n',
    "python": 'def fib(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
              '    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n'
              'if __name__ == "__main__":\n'
              '    print(fib(10))  # 55\n',
    "javascript": "const xs = [1, 2, 3].map((x) => x ** 2);\nconsole.log(`squares: ${xs.join(', ')}`);\n"
                  "export default async function f() { await Promise.all([]); }\r\n",
    "rust": "fn main() {\n    let v: Vec<u32> = (0..10).filter(|x| x % 2 == 0).collect();\n"
            "    println!(\"{:?}\", v);\n}\n",
    "html": '<!DOCTYPE html>\n<html lang="en">\n  <body><p class="x">Hello &amp; goodbye</p></body>\n'
            '</html>\n',
    "json": '{"name": "nanovllm", "version": [0, 1, 2], "nested": {"a": null, "b": true, "c": -1.5e-3}}',
    "shell": "#!/usr/bin/env bash\nset -euo pipefail\n"
             "for f in *.txt; do wc -l \"$f\" | awk '{print $1}'; done\n",
    "sql": "SELECT id, COUNT(*) AS n FROM users WHERE name LIKE 'A%' GROUP BY id HAVING n > 1;\n",
    "cuda": "__global__ void k(float* __restrict__ y, const float* x, int n) {\n"
            "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < n) y[i] = x[i] * 2.0f;\n}\n",
    "regex_and_symbols": r"s/^\s*(\w+)\s*=\s*(.*?);?$/\1: \2/g  =>  !== ||= &&= ::<> ->* ... "
                         r"### @@ -1,2 +1,3 @@",
    "markdown": "# Title\n\n* item one\n* item **two**\n\n```py\nprint('x')\n```\n\n| a | b |\n|---|---|\n",
    "latex": r"\begin{equation} \int_0^\infty e^{-x^2}\,dx = \frac{\sqrt{\pi}}{2} \end{equation}",
}

# ---- 3. Numbers in many scripts -------------------------------------------------------------------------
NUMBERS = {
    "ascii_digits": "0 1 12 123 1234 12345 3.14159 -42 1e10 0xFF 1,000,000 2024-01-31 12:34:56",
    "long_digits": "31415926535897932384626433832795028841971693993751058209749445923",
    "arabic_indic": "٠١٢٣٤٥٦٧٨٩ ۰۱۲۳۴۵۶۷۸۹",
    "devanagari_bengali": "०१२३४५६७८९ ০১২৩৪৫৬৭৮৯",
    "thai_lao_khmer_tibetan": "๐๑๒๓ ໐໑໒໓ ០១២៣ ༠༡༢༣",
    "fullwidth": "０１２３４５６７８９ ＡＢＣ",
    "roman_letterlike": "Ⅰ Ⅱ Ⅻ ⅰⅱⅲ ↁ ↂ 〇〡〢〣",
    "superscripts_fractions": "x² + y³ = z⁴ ½ ¼ ¾ ⅓ ₀₁₂ ① ② ⑳ ⓵ ❶ 𝟘𝟙𝟚",
    "cjk_numerals": "一二三四五六七八九十百千万亿 壹貳參",
    "math_alnum": "𝐀𝐁𝐂 𝑎𝑏𝑐 𝔸𝔹ℂ 𝟎𝟏𝟐 𝟶𝟷𝟸",
    "other_digits": "၀၁၂ ᠐᠑᠒ ߀߁߂ ꘠꘡ ᥆᥇ 𑁦𑁧 𞥐𞥑",
}

# ---- 4. Contractions in mixed case ------------------------------------------------------------------------
CONTRACTIONS = {
    "lower": "it's don't we're you've I'm we'll he'd",
    "upper": "IT'S DON'T WE'RE YOU'VE I'M WE'LL HE'D",
    "mixed": "It'S dOn'T wE'rE yOu'Ve i'M We'Ll hE'd 'Re 'rE 'vE 'LL 'lL 'Ll",
    "bare": "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D",
    "followed_by_letters": "'sand 'table 'really 'very 'more 'llama 'done 'xyz 'S'T",
    "long_s_and_others": "'ſ 'ſt 'ß 'İ 'ı 'K 'Å",
    "curly_and_modifier": "it’s don’t we‘re it`s it´s itʼs",
    "apostrophe_runs": "'' ''' 's's 's'' 'd'd'd ' s ' '\n's\n'",
    "digits_after": "'1 '12 's1 'm2",
}

# ---- 5. Whitespace edge cases ----------------------------------------------------------------------------
WHITESPACE = {
    "spaces_runs": "a  b   c    d     e",
    "leading_trailing": "   leading and trailing   ",
    "only_spaces": "     ",
    "single_space": " ",
    "newlines": "line1\nline2\n\nline3\n\n\n\nline4\n",
    "crlf": "line1\r\nline2\r\n\r\nline3\r\n",
    "cr_only": "a\rb\r\rc\r",
    "tabs": "\tindented\n\t\tdouble\t tab mix \t\n",
    "spaces_before_newline": "end   \n   start\n \n  \n",
    "nbsp": "a\u00a0b \u00a0c\u00a0\u00a0d \u00a0 e\u00a0",
    "ideographic_space": "日本\u3000語\u3000\u3000です",
    "unicode_spaces": "a\u2000b\u2001c\u2002d\u2003e\u2004f\u2005g\u2006h\u2007i\u2008j\u2009k\u200al",
    "line_separators": "a\u2028b\u2029c\u0085d\u000be\u000cf",
    "not_whitespace": "a\u200bb\u200cc\u200dd\ufeffe\u180ef\u2060g\u001cx\u001dy\u001ez\u001fw",
    "space_before_punct": "a ! b !! c ?! d ... e , f .",
    "space_before_digits": "a 1 b 22 c  333",
    "mixed_ws_runs": " \t \n \r\n\t  \u00a0 \u3000\n x",
    "trailing_newlines_after_punct": "end.\n\n\nnext!\r\n\r\nmore?\n",
    "empty": "",
    "newline_only": "\n",
    "nul_and_controls": "a\x00b\x01c\x7fd\x1be[0m",
}

# ---- 6. Text that NFC changes -----------------------------------------------------------------------------
NFC = {
    "combining_acute": "e\u0301 E\u0301 a\u0300 o\u0302\u0301 u\u0308",
    "angstrom_ohm_kelvin": "\u212b \u2126 \u212a A\u030a",
    "hangul_jamo": "\u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u1173\u11af \u1100\u1161 \uac00\u11a8",
    "mark_order": "a\u0323\u0307 a\u0307\u0323 q\u0307\u0323 s\u0323\u0307",
    "vietnamese_decomposed": "Vie\u0323\u0302t Nam ti\u00ea\u0301ng",
    "greek_decomposed": "\u03b1\u0301 \u03b9\u0308\u0301 \u03c9\u0342\u0345",
    "exclusions": "\u0958\u0959 \ufb2c \ufb1d \u2adc \u0f43",
    "devanagari_nukta": "\u0915\u093c \u0928\u093c \u0930\u093c",
    "indic_two_part_vowels": "\u0b95\u0bc6\u0bbe \u0d15\u0d46\u0d3e \u0995\u09c7\u09be \u0b15\u0b47\u0b3e",
    "singletons": "\u0340\u0341 \u0343 \u0374 \u037e \u0387 \u1f71 \u2000\u2001 \u2329\u232a",
    "many_marks": "a\u0301\u0302\u0303\u0304\u0305\u0306\u0307\u0308\u0309\u030a\u030b\u0323\u0324",
    "marks_alone": "\u0301 \u0301\u0301 \u0308a \u0345",
    "cjk_compat": "\uf900\uf901\ufa10 \u2f800",
    "less_than_overlay": "<\u0338 =\u0338 >\u0338",
}

# ---- 7. Emoji ----------------------------------------------------------------------------------------------
EMOJI = {
    "simple": "I ❤️ tokenizers 😀😃😄 🚀🔥",
    "zwj_family": "👨‍👩‍👧‍👦 👩‍💻 🏳️‍🌈 🧑‍🤝‍🧑",
    "skin_tones": "👍🏻 👍🏼 👍🏽 👍🏾 👍🏿 🧑🏽‍🚀",
    "flags": "🇯🇵 🇺🇸 🇩🇪 🇫🇷 🇺🇦 🇧🇷🇮🇳",
    "tag_sequence": "🏴󠁧󠁢󠁳󠁣󠁴󠁿 🏴󠁧󠁢󠁥󠁮󠁧󠁿",
    "keycaps_vs": "1️⃣ #️⃣ *️⃣ ☺︎ ☺️ ©️",
    "emoji_in_text": "hello😀world 😀, 😀.😀",
}

# ---- 8. Added tokens inside text ---------------------------------------------------------------------------
ADDED = {
    "chat": "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "think": "<think>\nLet me think.\n</think>\n\nThe answer is 42.",
    "adjacent": "<|im_end|><|im_end|><|endoftext|><think></think>",
    "spaces_around": " <think> x </think> ",
    "partial": "<|im_end <|im_end| < |im_end|> <|IM_END|> <think <think/> <|im_end|>>",
    "inside_words": "abc<|endoftext|>def 123<tool_call>456</tool_call>end",
    "all_added": "<|endoftext|><|im_start|><|im_end|><|object_ref_start|><|object_ref_end|><|box_start|>"
                 "<|box_end|><|quad_start|><|quad_end|><|vision_start|><|vision_end|><|vision_pad|>"
                 "<|image_pad|><|video_pad|><tool_call></tool_call><|fim_prefix|><|fim_middle|><|fim_suffix|>"
                 "<|fim_pad|><|repo_name|><|file_sep|><tool_response></tool_response><think></think>",
    "newline_after": "<|im_end|>\n\n\n<|im_start|>",
    "nfc_across": "e<think>\u0301 e\u0301<think>",
}

# ---- 9. Long inputs (BPE on long words, long runs) ------------------------------------------------------
LONG = {
    "long_letters": "a" * 3000,
    "long_word_mixed": "Supercalifragilisticexpialidocious" * 60,
    "long_spaces": " " * 1000 + "x" + " " * 999,
    "long_newlines": "\n" * 500 + "x" + "\r\n" * 300,
    "long_punct": "=" * 700 + "-" * 300 + "!?" * 200,
    "long_cjk": "的一是不了人我在有他这为之大来以个中上们到说国和地也子时道出要就下得可你年生" * 20,
    "long_digits": "9" * 2000,
    "base64": "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWZnaGlqa2xtbm9wcXJzdHV2d3h5ejAxMjM0NTY3ODk" * 30,
    "long_thai": "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ" * 50,
}

# ---- 10. Every assigned Unicode block (Blocks.txt of Unicode 15.0, plus the blocks of 15.1 and 16.0) ----
BLOCKS = """
0000 007F Basic Latin
0080 00FF Latin-1 Supplement
0100 017F Latin Extended-A
0180 024F Latin Extended-B
0250 02AF IPA Extensions
02B0 02FF Spacing Modifier Letters
0300 036F Combining Diacritical Marks
0370 03FF Greek and Coptic
0400 04FF Cyrillic
0500 052F Cyrillic Supplement
0530 058F Armenian
0590 05FF Hebrew
0600 06FF Arabic
0700 074F Syriac
0750 077F Arabic Supplement
0780 07BF Thaana
07C0 07FF NKo
0800 083F Samaritan
0840 085F Mandaic
0860 086F Syriac Supplement
0870 089F Arabic Extended-B
08A0 08FF Arabic Extended-A
0900 097F Devanagari
0980 09FF Bengali
0A00 0A7F Gurmukhi
0A80 0AFF Gujarati
0B00 0B7F Oriya
0B80 0BFF Tamil
0C00 0C7F Telugu
0C80 0CFF Kannada
0D00 0D7F Malayalam
0D80 0DFF Sinhala
0E00 0E7F Thai
0E80 0EFF Lao
0F00 0FFF Tibetan
1000 109F Myanmar
10A0 10FF Georgian
1100 11FF Hangul Jamo
1200 137F Ethiopic
1380 139F Ethiopic Supplement
13A0 13FF Cherokee
1400 167F Unified Canadian Aboriginal Syllabics
1680 169F Ogham
16A0 16FF Runic
1700 171F Tagalog
1720 173F Hanunoo
1740 175F Buhid
1760 177F Tagbanwa
1780 17FF Khmer
1800 18AF Mongolian
18B0 18FF Unified Canadian Aboriginal Syllabics Extended
1900 194F Limbu
1950 197F Tai Le
1980 19DF New Tai Lue
19E0 19FF Khmer Symbols
1A00 1A1F Buginese
1A20 1AAF Tai Tham
1AB0 1AFF Combining Diacritical Marks Extended
1B00 1B7F Balinese
1B80 1BBF Sundanese
1BC0 1BFF Batak
1C00 1C4F Lepcha
1C50 1C7F Ol Chiki
1C80 1C8F Cyrillic Extended-C
1C90 1CBF Georgian Extended
1CC0 1CCF Sundanese Supplement
1CD0 1CFF Vedic Extensions
1D00 1D7F Phonetic Extensions
1D80 1DBF Phonetic Extensions Supplement
1DC0 1DFF Combining Diacritical Marks Supplement
1E00 1EFF Latin Extended Additional
1F00 1FFF Greek Extended
2000 206F General Punctuation
2070 209F Superscripts and Subscripts
20A0 20CF Currency Symbols
20D0 20FF Combining Diacritical Marks for Symbols
2100 214F Letterlike Symbols
2150 218F Number Forms
2190 21FF Arrows
2200 22FF Mathematical Operators
2300 23FF Miscellaneous Technical
2400 243F Control Pictures
2440 245F Optical Character Recognition
2460 24FF Enclosed Alphanumerics
2500 257F Box Drawing
2580 259F Block Elements
25A0 25FF Geometric Shapes
2600 26FF Miscellaneous Symbols
2700 27BF Dingbats
27C0 27EF Miscellaneous Mathematical Symbols-A
27F0 27FF Supplemental Arrows-A
2800 28FF Braille Patterns
2900 297F Supplemental Arrows-B
2980 29FF Miscellaneous Mathematical Symbols-B
2A00 2AFF Supplemental Mathematical Operators
2B00 2BFF Miscellaneous Symbols and Arrows
2C00 2C5F Glagolitic
2C60 2C7F Latin Extended-C
2C80 2CFF Coptic
2D00 2D2F Georgian Supplement
2D30 2D7F Tifinagh
2D80 2DDF Ethiopic Extended
2DE0 2DFF Cyrillic Extended-A
2E00 2E7F Supplemental Punctuation
2E80 2EFF CJK Radicals Supplement
2F00 2FDF Kangxi Radicals
2FF0 2FFF Ideographic Description Characters
3000 303F CJK Symbols and Punctuation
3040 309F Hiragana
30A0 30FF Katakana
3100 312F Bopomofo
3130 318F Hangul Compatibility Jamo
3190 319F Kanbun
31A0 31BF Bopomofo Extended
31C0 31EF CJK Strokes
31F0 31FF Katakana Phonetic Extensions
3200 32FF Enclosed CJK Letters and Months
3300 33FF CJK Compatibility
3400 4DBF CJK Unified Ideographs Extension A
4DC0 4DFF Yijing Hexagram Symbols
4E00 9FFF CJK Unified Ideographs
A000 A48F Yi Syllables
A490 A4CF Yi Radicals
A4D0 A4FF Lisu
A500 A63F Vai
A640 A69F Cyrillic Extended-B
A6A0 A6FF Bamum
A700 A71F Modifier Tone Letters
A720 A7FF Latin Extended-D
A800 A82F Syloti Nagri
A830 A83F Common Indic Number Forms
A840 A87F Phags-pa
A880 A8DF Saurashtra
A8E0 A8FF Devanagari Extended
A900 A92F Kayah Li
A930 A95F Rejang
A960 A97F Hangul Jamo Extended-A
A980 A9DF Javanese
A9E0 A9FF Myanmar Extended-B
AA00 AA5F Cham
AA60 AA7F Myanmar Extended-A
AA80 AADF Tai Viet
AAE0 AAFF Meetei Mayek Extensions
AB00 AB2F Ethiopic Extended-A
AB30 AB6F Latin Extended-E
AB70 ABBF Cherokee Supplement
ABC0 ABFF Meetei Mayek
AC00 D7AF Hangul Syllables
D7B0 D7FF Hangul Jamo Extended-B
D800 DB7F High Surrogates
DB80 DBFF High Private Use Surrogates
DC00 DFFF Low Surrogates
E000 F8FF Private Use Area
F900 FAFF CJK Compatibility Ideographs
FB00 FB4F Alphabetic Presentation Forms
FB50 FDFF Arabic Presentation Forms-A
FE00 FE0F Variation Selectors
FE10 FE1F Vertical Forms
FE20 FE2F Combining Half Marks
FE30 FE4F CJK Compatibility Forms
FE50 FE6F Small Form Variants
FE70 FEFF Arabic Presentation Forms-B
FF00 FFEF Halfwidth and Fullwidth Forms
FFF0 FFFF Specials
10000 1007F Linear B Syllabary
10080 100FF Linear B Ideograms
10100 1013F Aegean Numbers
10140 1018F Ancient Greek Numbers
10190 101CF Ancient Symbols
101D0 101FF Phaistos Disc
10280 1029F Lycian
102A0 102DF Carian
102E0 102FF Coptic Epact Numbers
10300 1032F Old Italic
10330 1034F Gothic
10350 1037F Old Permic
10380 1039F Ugaritic
103A0 103DF Old Persian
10400 1044F Deseret
10450 1047F Shavian
10480 104AF Osmanya
104B0 104FF Osage
10500 1052F Elbasan
10530 1056F Caucasian Albanian
10570 105BF Vithkuqi
105C0 105FF Todhri (16.0)
10600 1077F Linear A
10780 107BF Latin Extended-F
10800 1083F Cypriot Syllabary
10840 1085F Imperial Aramaic
10860 1087F Palmyrene
10880 108AF Nabataean
108E0 108FF Hatran
10900 1091F Phoenician
10920 1093F Lydian
10980 1099F Meroitic Hieroglyphs
109A0 109FF Meroitic Cursive
10A00 10A5F Kharoshthi
10A60 10A7F Old South Arabian
10A80 10A9F Old North Arabian
10AC0 10AFF Manichaean
10B00 10B3F Avestan
10B40 10B5F Inscriptional Parthian
10B60 10B7F Inscriptional Pahlavi
10B80 10BAF Psalter Pahlavi
10C00 10C4F Old Turkic
10C80 10CFF Old Hungarian
10D00 10D3F Hanifi Rohingya
10D40 10D8F Garay (16.0)
10E60 10E7F Rumi Numeral Symbols
10E80 10EBF Yezidi
10EC0 10EFF Arabic Extended-C
10F00 10F2F Old Sogdian
10F30 10F6F Sogdian
10F70 10FAF Old Uyghur
10FB0 10FDF Chorasmian
10FE0 10FFF Elymaic
11000 1107F Brahmi
11080 110CF Kaithi
110D0 110FF Sora Sompeng
11100 1114F Chakma
11150 1117F Mahajani
11180 111DF Sharada
111E0 111FF Sinhala Archaic Numbers
11200 1124F Khojki
11280 112AF Multani
112B0 112FF Khudawadi
11300 1137F Grantha
11380 113FF Tulu-Tigalari (16.0)
11400 1147F Newa
11480 114DF Tirhuta
11580 115FF Siddham
11600 1165F Modi
11660 1167F Mongolian Supplement
11680 116CF Takri
116D0 116FF Myanmar Extended-C (16.0)
11700 1174F Ahom
11800 1184F Dogra
118A0 118FF Warang Citi
11900 1195F Dives Akuru
119A0 119FF Nandinagari
11A00 11A4F Zanabazar Square
11A50 11AAF Soyombo
11AB0 11ABF Unified Canadian Aboriginal Syllabics Extended-A
11AC0 11AFF Pau Cin Hau
11B00 11B5F Devanagari Extended-A
11BC0 11BFF Sunuwar (16.0)
11C00 11C6F Bhaiksuki
11C70 11CBF Marchen
11D00 11D5F Masaram Gondi
11D60 11DAF Gunjala Gondi
11EE0 11EFF Makasar
11F00 11F5F Kawi
11FB0 11FBF Lisu Supplement
11FC0 11FFF Tamil Supplement
12000 123FF Cuneiform
12400 1247F Cuneiform Numbers and Punctuation
12480 1254F Early Dynastic Cuneiform
12F90 12FFF Cypro-Minoan
13000 1342F Egyptian Hieroglyphs
13430 1345F Egyptian Hieroglyph Format Controls
13460 143FF Egyptian Hieroglyphs Extended-A (16.0)
14400 1467F Anatolian Hieroglyphs
16100 1613F Gurung Khema (16.0)
16800 16A3F Bamum Supplement
16A40 16A6F Mro
16A70 16ACF Tangsa
16AD0 16AFF Bassa Vah
16B00 16B8F Pahawh Hmong
16D40 16D7F Kirat Rai (16.0)
16E40 16E9F Medefaidrin
16F00 16F9F Miao
16FE0 16FFF Ideographic Symbols and Punctuation
17000 187FF Tangut
18800 18AFF Tangut Components
18B00 18CFF Khitan Small Script
18D00 18D7F Tangut Supplement
1AFF0 1AFFF Kana Extended-B
1B000 1B0FF Kana Supplement
1B100 1B12F Kana Extended-A
1B130 1B16F Small Kana Extension
1B170 1B2FF Nushu
1BC00 1BC9F Duployan
1BCA0 1BCAF Shorthand Format Controls
1CC00 1CEBF Symbols for Legacy Computing Supplement (16.0)
1CF00 1CFCF Znamenny Musical Notation
1D000 1D0FF Byzantine Musical Symbols
1D100 1D1FF Musical Symbols
1D200 1D24F Ancient Greek Musical Notation
1D2C0 1D2DF Kaktovik Numerals
1D2E0 1D2FF Mayan Numerals
1D300 1D35F Tai Xuan Jing Symbols
1D360 1D37F Counting Rod Numerals
1D400 1D7FF Mathematical Alphanumeric Symbols
1D800 1DAAF Sutton SignWriting
1DF00 1DFFF Latin Extended-G
1E000 1E02F Glagolitic Supplement
1E030 1E08F Cyrillic Extended-D
1E100 1E14F Nyiakeng Puachue Hmong
1E290 1E2BF Toto
1E2C0 1E2FF Wancho
1E4D0 1E4FF Nag Mundari
1E5D0 1E5FF Ol Onal (16.0)
1E7E0 1E7FF Ethiopic Extended-B
1E800 1E8DF Mende Kikakui
1E900 1E95F Adlam
1EC70 1ECBF Indic Siyaq Numbers
1ED00 1ED4F Ottoman Siyaq Numbers
1EE00 1EEFF Arabic Mathematical Alphabetic Symbols
1F000 1F02F Mahjong Tiles
1F030 1F09F Domino Tiles
1F0A0 1F0FF Playing Cards
1F100 1F1FF Enclosed Alphanumeric Supplement
1F200 1F2FF Enclosed Ideographic Supplement
1F300 1F5FF Miscellaneous Symbols and Pictographs
1F600 1F64F Emoticons
1F650 1F67F Ornamental Dingbats
1F680 1F6FF Transport and Map Symbols
1F700 1F77F Alchemical Symbols
1F780 1F7FF Geometric Shapes Extended
1F800 1F8FF Supplemental Arrows-C
1F900 1F9FF Supplemental Symbols and Pictographs
1FA00 1FA6F Chess Symbols
1FA70 1FAFF Symbols and Pictographs Extended-A
1FB00 1FBFF Symbols for Legacy Computing
20000 2A6DF CJK Unified Ideographs Extension B
2A700 2B73F CJK Unified Ideographs Extension C
2B740 2B81F CJK Unified Ideographs Extension D
2B820 2CEAF CJK Unified Ideographs Extension E
2CEB0 2EBEF CJK Unified Ideographs Extension F
2EBF0 2EE5F CJK Unified Ideographs Extension I (15.1)
2F800 2FA1F CJK Compatibility Ideographs Supplement
30000 3134F CJK Unified Ideographs Extension G
31350 323AF CJK Unified Ideographs Extension H
E0000 E007F Tags
E0100 E01EF Variation Selectors Supplement
F0000 FFFFF Supplementary Private Use Area-A
100000 10FFFF Supplementary Private Use Area-B
"""

# Characters mixed into the random block strings so that every block also meets spaces, newlines, digits,
# ASCII letters, punctuation and apostrophes (the pre-tokenizer's boundaries).
MIXERS = [" ", " ", "  ", "\n", "\r\n", "\t", "a", "Z", "7", ".", "'", "'s", "\u00a0", "\u0301"]


def blocks():
    out = []
    for line in BLOCKS.strip().splitlines():
        start, end, name = line.split(" ", 2)
        out.append((int(start, 16), int(end, 16), name))
    return out


def random_block_cases(rng):
    cases = []
    for start, end, name in blocks():
        if 0xD800 <= start <= 0xDFFF:
            continue  # surrogates cannot appear in UTF-8 text
        for k in range(3):
            chars = []
            for _ in range(rng.randint(8, 40)):
                if k > 0 and rng.random() < 0.25:
                    chars.append(rng.choice(MIXERS))
                else:
                    chars.append(chr(rng.randint(start, end)))
            cases.append((f"block/{name}/{k}", "".join(chars)))
    return cases


# Short random strings over small alphabets that stress the split regex: every alternative, its order and
# backtracking (contractions, optional prefix before letters, ` ?` before punctuation, \s*[\r\n]+,
# \s+(?!\S)).
REGEX_ALPHABET = ["a", "b", "S", "T", "s", "t", "re", "RE", "ve", "m", "ll", "d", "D", "'", "'", "1", "23",
                  " ", " ", " ", "\t", "\n", "\r", "\r\n", ".", "!", "-", "(", "\u00a0", "\u3000", "é",
                  "e\u0301", "\u0301", "中", "ж", "١", "Ⅻ", "½", "😀", "\u200d", "\u2028", "\x0b", "\x0c",
                  "<think>", "<|im_end|>", "<", "|", ">"]


def random_regex_cases(rng, n):
    cases = []
    for i in range(n):
        s = "".join(rng.choice(REGEX_ALPHABET) for _ in range(rng.randint(1, 24)))
        cases.append((f"regex/{i}", s))
    return cases


def random_ascii_cases(rng, n):
    alphabet = [chr(c) for c in range(33, 127)] + ["\n", "\t", "\r"] * 3 + [" "] * 10
    return [(f"ascii/{i}", "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
            for i in range(n)]


def random_codepoint_cases(rng, n):
    """Uniformly random code points over the whole range (assigned or not), surrogates excluded."""
    cases = []
    for i in range(n):
        chars = []
        for _ in range(rng.randint(1, 30)):
            c = rng.randint(0, 0x10FFFF)
            while 0xD800 <= c <= 0xDFFF:
                c = rng.randint(0, 0x10FFFF)
            chars.append(chr(c))
        cases.append((f"anycp/{i}", "".join(chars)))
    return cases


def cases():
    out = []
    groups = [("lang", LANGUAGES), ("code", CODE), ("num", NUMBERS), ("contraction", CONTRACTIONS),
              ("ws", WHITESPACE), ("nfc", NFC), ("emoji", EMOJI), ("added", ADDED), ("long", LONG)]
    for group, table in groups:
        out += [(f"{group}/{k}", v) for k, v in table.items()]
    out.append(("lang/all_joined", "\n".join(LANGUAGES.values())))
    out.append(("code/all_joined", "\n\n".join(CODE.values())))
    rng = random.Random(20261121)
    out += random_block_cases(rng)
    out += random_regex_cases(rng, 600)
    out += random_ascii_cases(rng, 200)
    out += random_codepoint_cases(rng, 100)
    return out


if __name__ == "__main__":
    cs = cases()
    names = set()
    for name, _ in cs:
        assert name not in names, name
        names.add(name)
    print(f"{len(cs)} cases, {sum(len(t) for _, t in cs)} characters, "
          f"{sum(len(t.encode('utf-8')) for _, t in cs)} UTF-8 bytes, {len(blocks())} blocks")
