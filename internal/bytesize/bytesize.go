// Package bytesize parses and formats byte sizes for flags and tables
// ("10GiB", "1.5 GiB").
package bytesize

import (
	"fmt"
	"math"
	"math/big"
	"strconv"
	"strings"
)

// sizeUnits maps the units Parse accepts (lower-cased) to their size in
// bytes: binary units (KiB = 1024 B) and decimal ones (KB = 1000 B).
var sizeUnits = map[string]uint64{
	"":    1,
	"b":   1,
	"kib": 1 << 10,
	"mib": 1 << 20,
	"gib": 1 << 30,
	"tib": 1 << 40,
	"pib": 1 << 50,
	"kb":  1e3,
	"mb":  1e6,
	"gb":  1e9,
	"tb":  1e12,
}

const sizeUnitList = "B, KiB, MiB, GiB, TiB, PiB, KB, MB, GB, TB"

// Parse parses a size in bytes: a non-negative decimal number, possibly
// fractional ("1.5"), followed by an optional unit, case-insensitive: B, the
// binary KiB, MiB, GiB, TiB, PiB, or the decimal KB, MB, GB, TB. Space between
// number and unit is allowed. A fractional result is rounded up to a whole
// byte. Zero, negative sizes, sizes above math.MaxUint64 bytes and anything
// else are errors.
func Parse(s string) (uint64, error) {
	in := strings.TrimSpace(s)
	if in == "" {
		return 0, fmt.Errorf("invalid size %q: empty", s)
	}
	if strings.HasPrefix(in, "-") {
		return 0, fmt.Errorf("invalid size %q: must not be negative", s)
	}
	end := 0
	digits, dots := 0, 0
	for ; end < len(in); end++ {
		c := in[end]
		if c == '.' {
			dots++
			continue
		}
		if c < '0' || c > '9' {
			break
		}
		digits++
	}
	if digits == 0 || dots > 1 {
		return 0, fmt.Errorf("invalid size %q: want a number and an optional unit (%s)", s, sizeUnitList)
	}
	number, unit := in[:end], strings.TrimSpace(in[end:])
	mult, ok := sizeUnits[strings.ToLower(unit)]
	if !ok {
		return 0, fmt.Errorf("invalid size %q: unknown unit %q (want %s)", s, unit, sizeUnitList)
	}
	r, ok := new(big.Rat).SetString(number)
	if !ok {
		return 0, fmt.Errorf("invalid size %q: want a number and an optional unit (%s)", s, sizeUnitList)
	}
	r.Mul(r, new(big.Rat).SetUint64(mult))
	// Round up to a whole byte: ceil(num/den).
	q, m := new(big.Int).QuoRem(r.Num(), r.Denom(), new(big.Int))
	if m.Sign() != 0 {
		q.Add(q, big.NewInt(1))
	}
	if q.Sign() == 0 {
		return 0, fmt.Errorf("invalid size %q: must be greater than zero", s)
	}
	if !q.IsUint64() {
		return 0, fmt.Errorf("invalid size %q: larger than the maximum of %d bytes", s, uint64(math.MaxUint64))
	}
	return q.Uint64(), nil
}

// binaryUnits are the units Format uses, smallest first.
var binaryUnits = []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}

// Format formats a byte count in the largest binary unit it reaches, with
// at most one decimal: "512 B", "1.5 GiB", "10 GiB". The value is rounded to
// the nearest tenth, so it is exact only when it shows no more precision
// than that.
func Format(b uint64) string {
	i := 0
	for i+1 < len(binaryUnits) && b >= 1<<(10*(i+1)) {
		i++
	}
	if i == 0 {
		return strconv.FormatUint(b, 10) + " B"
	}
	v := math.Round(float64(b)/float64(uint64(1)<<(10*i))*10) / 10
	if v >= 1024 && i+1 < len(binaryUnits) {
		i++
		v = math.Round(float64(b)/float64(uint64(1)<<(10*i))*10) / 10
	}
	return strconv.FormatFloat(v, 'f', -1, 64) + " " + binaryUnits[i]
}
