package idem

import (
	"encoding/json"
	"strings"
	"unicode/utf8"
)

// What idem stores. Every text and value idem writes (a result, an error
// text, a reason, a header or URL kept by the inbox) passes through here
// first: a value PostgreSQL would refuse is refused with ErrInvalidInput
// before any statement is sent, so that a refusal never aborts the
// caller's transaction, and a text that only reports something (an error,
// a reason) is made storable instead of refused.

// MaxTextBytes is the longest error text or reason idem stores (the SQL
// functions keep the first 8,192 characters; StorableText cuts at 8,192
// bytes, on a character boundary).
const MaxTextBytes = 8192

// MaxResultBytes is the largest stored result: 1 MiB as jsonb, PostgreSQL's
// binary form, whose size only the server knows exactly (ErrResultTooLarge).
const MaxResultBytes = 1 << 20

// mayExceedLimit: a result whose text is this long may be over
// MaxResultBytes as jsonb (jsonb takes up to 6 times the text's bytes: a
// long array of 0s). Inside the caller's transaction such a result is
// completed under a savepoint, so that the server's refusal leaves the
// transaction usable.
const mayExceedLimit = MaxResultBytes / 8

// StorableText returns s as idem stores an error text or a reason: invalid
// UTF-8 and NUL characters, which PostgreSQL text cannot hold, become
// U+FFFD, and it is cut to MaxTextBytes on a character boundary. Every
// error text idem records (Fail, CompleteUnstored, the inbox's dead
// letters and River's attempt errors) goes through it.
func StorableText(s string) string {
	if utf8.ValidString(s) && strings.IndexByte(s, 0) < 0 && len(s) <= MaxTextBytes {
		return s
	}
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", "\uFFFD")
	if len(s) > MaxTextBytes {
		cut := MaxTextBytes
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut]
	}
	return s
}

// CheckText reports, as an *Error matching ErrInvalidInput naming what,
// a text PostgreSQL's text (and jsonb) cannot hold: invalid UTF-8, or a
// NUL character. Sources, keys, fingerprints and event types are checked
// with it before a claim, and the inbox checks what it stores with a
// delivery (its request target, route pattern, host and headers).
func CheckText(what, s string) error {
	var problem string
	switch {
	case !utf8.ValidString(s):
		problem = " is not valid UTF-8"
	case strings.IndexByte(s, 0) >= 0:
		problem = " contains a NUL byte"
	default:
		return nil
	}
	return &Error{Kind: ErrInvalidInput, Err: errorString(what + problem)}
}

// CheckResult reports, as an *Error matching ErrInvalidInput, a result
// PostgreSQL's jsonb would refuse: not valid UTF-8, not JSON, a \u0000
// escape, a lone UTF-16 surrogate escape (\ud800 without its pair), or a
// number outside PostgreSQL's numeric range (over 131,072 digits before
// the decimal point, or over 16,383 after it). nil is valid (no result).
// The size limit (MaxResultBytes as jsonb) is the server's to check. Do,
// Complete and the inbox's completion call it before the statement.
func CheckResult(result []byte) error {
	if result == nil {
		return nil
	}
	var problem string
	switch {
	case !utf8.Valid(result):
		problem = "result is not valid UTF-8"
	case !json.Valid(result):
		problem = "result is not valid JSON"
	default:
		problem = jsonbProblem(result)
	}
	if problem == "" {
		return nil
	}
	return &Error{Op: "complete", Kind: ErrInvalidInput, Err: errorString(problem)}
}

// jsonbProblem scans valid JSON for what jsonb refuses and JSON allows.
func jsonbProblem(b []byte) string {
	for i := 0; i < len(b); {
		switch c := b[i]; {
		case c == '"':
			end, problem := scanString(b, i+1)
			if problem != "" {
				return problem
			}
			i = end
		case c == '-' || c >= '0' && c <= '9':
			end, problem := scanNumber(b, i)
			if problem != "" {
				return problem
			}
			i = end
		default:
			i++
		}
	}
	return ""
}

// scanString checks the escapes of the string starting at b[i] (after its
// opening quote) and returns the index after its closing quote.
func scanString(b []byte, i int) (int, string) {
	pendingHigh := false // the previous escape was a high surrogate
	for i < len(b) {
		c := b[i]
		if c == '"' {
			if pendingHigh {
				return 0, "result holds a lone UTF-16 surrogate escape (\\ud800-\\udbff without its pair)"
			}
			return i + 1, ""
		}
		if c != '\\' {
			if pendingHigh {
				return 0, "result holds a lone UTF-16 surrogate escape (\\ud800-\\udbff without its pair)"
			}
			i++
			continue
		}
		if b[i+1] != 'u' {
			if pendingHigh {
				return 0, "result holds a lone UTF-16 surrogate escape (\\ud800-\\udbff without its pair)"
			}
			i += 2
			continue
		}
		r := hex4(b[i+2 : i+6])
		switch {
		case r == 0:
			return 0, "result holds a \\u0000 escape (a NUL character), which PostgreSQL cannot store"
		case r >= 0xD800 && r <= 0xDBFF:
			if pendingHigh {
				return 0, "result holds a lone UTF-16 surrogate escape (\\ud800-\\udbff without its pair)"
			}
			pendingHigh = true
		case r >= 0xDC00 && r <= 0xDFFF:
			if !pendingHigh {
				return 0, "result holds a lone UTF-16 surrogate escape (\\udc00-\\udfff without its pair)"
			}
			pendingHigh = false
		default:
			if pendingHigh {
				return 0, "result holds a lone UTF-16 surrogate escape (\\ud800-\\udbff without its pair)"
			}
		}
		i += 6
	}
	return i, ""
}

func hex4(h []byte) rune {
	var r rune
	for _, c := range h {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c-'a') + 10
		case c >= 'A' && c <= 'F':
			r |= rune(c-'A') + 10
		}
	}
	return r
}

// PostgreSQL numeric's range (numeric.c): at most 131,072 decimal digits
// before the point (weight) and 16,383 after it (display scale); an
// exponent beyond ±(2^31-1)/2 is refused outright.
const (
	numericMaxWeight = 131072
	numericMaxScale  = 16383
	numericMaxExp    = (1<<31 - 1) / 2
)

// scanNumber checks the JSON number at b[i] against numeric's range and
// returns the index after it.
func scanNumber(b []byte, i int) (int, string) {
	if b[i] == '-' {
		i++
	}
	lead := -1 // index among the integer digits of the first non-zero digit
	intDigits := 0
	for ; i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
		if lead < 0 && b[i] != '0' {
			lead = intDigits
		}
		intDigits++
	}
	fracDigits, fracLead := 0, -1
	if i < len(b) && b[i] == '.' {
		for i++; i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
			if fracLead < 0 && b[i] != '0' {
				fracLead = fracDigits
			}
			fracDigits++
		}
	}
	exp := 0
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		neg := false
		if b[i] == '+' || b[i] == '-' {
			neg = b[i] == '-'
			i++
		}
		for ; i < len(b) && b[i] >= '0' && b[i] <= '9'; i++ {
			if exp < numericMaxExp {
				exp = exp*10 + int(b[i]-'0')
			}
		}
		if exp >= numericMaxExp {
			return 0, "result holds a number outside PostgreSQL's numeric range"
		}
		if neg {
			exp = -exp
		}
	}
	// The power of ten of the most significant non-zero digit, plus one:
	// the digits before the point.
	weight := 0
	switch {
	case lead >= 0:
		weight = intDigits - lead + exp
	case fracLead >= 0:
		weight = -fracLead + exp
	}
	if (lead >= 0 || fracLead >= 0) && weight > numericMaxWeight {
		return 0, "result holds a number outside PostgreSQL's numeric range (over 131,072 digits before the decimal point)"
	}
	if max(fracDigits-exp, 0) > numericMaxScale {
		return 0, "result holds a number outside PostgreSQL's numeric range (over 16,383 digits after the decimal point)"
	}
	return i, ""
}
