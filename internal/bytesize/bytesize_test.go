package bytesize

import (
	"math"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    uint64
		wantErr string // substring of the error; "" means success
	}{
		{in: "4096", want: 4096},
		{in: "512B", want: 512},
		{in: "512 b", want: 512},
		{in: "1KiB", want: 1024},
		{in: "10GiB", want: 10737418240},
		{in: "10gib", want: 10737418240},
		{in: "10 GIB", want: 10737418240},
		{in: " 2MiB ", want: 2 << 20},
		{in: "1.5GiB", want: 1610612736},
		{in: ".5KiB", want: 512},
		{in: "3TiB", want: 3 << 40},
		{in: "1PiB", want: 1 << 50},
		{in: "1KB", want: 1000},
		{in: "2.5MB", want: 2500000},
		{in: "10GB", want: 10000000000},
		{in: "1tb", want: 1000000000000},
		{in: "0.1KiB", want: 103}, // 102.4 rounded up to a whole byte
		{in: "16383PiB", want: 16383 << 50},
		{in: "18446744073709551615", want: math.MaxUint64},

		{in: "", wantErr: "empty"},
		{in: "   ", wantErr: "empty"},
		{in: "0", wantErr: "greater than zero"},
		{in: "0GiB", wantErr: "greater than zero"},
		{in: "0.0", wantErr: "greater than zero"},
		{in: "-1", wantErr: "negative"},
		{in: "-10GiB", wantErr: "negative"},
		{in: "18446744073709551616", wantErr: "maximum"},
		{in: "16384PiB", wantErr: "maximum"},
		{in: "99999999999999999999TB", wantErr: "maximum"},
		{in: "GiB", wantErr: "want a number"},
		{in: "abc", wantErr: "want a number"},
		{in: ".", wantErr: "want a number"},
		{in: "1.2.3GiB", wantErr: "want a number"},
		{in: "+5GiB", wantErr: "want a number"},
		{in: "10XB", wantErr: `unknown unit "XB"`},
		{in: "10G", wantErr: `unknown unit "G"`},
		{in: "10 GiB extra", wantErr: "unknown unit"},
		{in: "1e9", wantErr: `unknown unit "e9"`},
		{in: "0x10", wantErr: "unknown unit"},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := Parse(tc.in)
			if tc.wantErr != "" {
				if err == nil {
					t.Fatalf("Parse(%q) = %d, want an error containing %q", tc.in, got, tc.wantErr)
				}
				if !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Parse(%q) error = %q, want it to contain %q", tc.in, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Parse(%q): %v", tc.in, err)
			}
			if got != tc.want {
				t.Fatalf("Parse(%q) = %d, want %d", tc.in, got, tc.want)
			}
		})
	}
}

func TestFormat(t *testing.T) {
	for _, tc := range []struct {
		in   uint64
		want string
	}{
		{0, "0 B"},
		{1, "1 B"},
		{512, "512 B"},
		{1023, "1023 B"},
		{1024, "1 KiB"},
		{1536, "1.5 KiB"},
		{10 << 30, "10 GiB"},
		{1610612736, "1.5 GiB"},
		{10737418240 + 4096, "10 GiB"},
		{(1 << 20) - 1, "1 MiB"}, // 1023.999 KiB rounds into the next unit
		{3 << 40, "3 TiB"},
		{5 << 50, "5 PiB"},
		{1 << 60, "1 EiB"},
		{math.MaxUint64, "16 EiB"},
	} {
		if got := Format(tc.in); got != tc.want {
			t.Errorf("Format(%d) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestSizeRoundTrip checks that what Format prints parses back to the
// same number of bytes when it is exact.
func TestSizeRoundTrip(t *testing.T) {
	for _, b := range []uint64{1, 512, 1024, 1536, 10 << 30, 1610612736, 7 << 40} {
		s := strings.ReplaceAll(Format(b), " ", "")
		got, err := Parse(s)
		if err != nil || got != b {
			t.Errorf("Parse(Format(%d) = %q) = %d, %v", b, s, got, err)
		}
	}
}
