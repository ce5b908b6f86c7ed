package cli

import (
	"math"

	"golang.org/x/text/language"
	"golang.org/x/text/message"
)

// Text output writes numbers for people (5,257 rows/s); --json writes them
// exactly. The grouping is golang.org/x/text's, in English.
var printer = message.NewPrinter(language.English)

// human is n with thousands separators: 1234567 is "1,234,567".
func human(n int64) string { return printer.Sprintf("%d", n) }

// humanRate is a rate rounded to a whole number, with separators.
func humanRate(r float64) string {
	if math.IsNaN(r) || math.IsInf(r, 0) {
		return "-"
	}
	return printer.Sprintf("%d", int64(math.Round(r)))
}
