package ctl

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf16"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

var jsonOptions = protojson.MarshalOptions{Multiline: true, EmitUnpopulated: true}

// jsonOutput reports whether -o json was asked for.
func (a *app) jsonOutput() bool { return a.output == outputJSON }

// printJSON writes m as protojson followed by a newline.
func (a *app) printJSON(m proto.Message) error {
	b, err := jsonOptions.Marshal(m)
	if err != nil {
		return fmt.Errorf("encode %s: %w", m.ProtoReflect().Descriptor().FullName(), err)
	}
	_, err = fmt.Fprintf(a.stdout, "%s\n", escapeJSON(b))
	return err
}

// escapeJSON writes the non-printable runes protojson leaves raw (DEL, C1
// controls, format characters such as U+202E) as \u escapes. They can
// only stand inside JSON strings, where the escape means the same rune.
func escapeJSON(b []byte) []byte {
	out := make([]byte, 0, len(b))
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError || r == '\n' || r == ' ' || strconv.IsPrint(r) {
			out = append(out, b[i:i+n]...)
		} else if r1, r2 := utf16.EncodeRune(r); r1 != utf8.RuneError {
			out = fmt.Appendf(out, `\u%04x\u%04x`, r1, r2)
		} else {
			out = fmt.Appendf(out, `\u%04x`, r)
		}
		i += n
	}
	return out
}

// table collects tab-separated rows and aligns them on flush.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 0, 3, ' ', 0)}
	if len(header) > 0 {
		t.row(header...)
	}
	return t
}

func (t *table) row(cells ...string) {
	clean := make([]string, len(cells))
	for i, c := range cells {
		clean[i] = escape(c)
	}
	fmt.Fprintln(t.tw, strings.Join(clean, "\t"))
}

func (t *table) flush() error { return t.tw.Flush() }

// escape is the one helper that makes text from the cluster (names,
// labels, error messages, events) safe to print: every rune that is not
// printable (C0 and C1 control characters, DEL, newlines and tabs, Unicode
// format characters such as bidirectional overrides) and every invalid
// UTF-8 byte is written as a Go escape (\x1b, \n, \u202e). Tables and
// fields escape every cell; errors are escaped before they are printed;
// and the writers stor-ctl prints through escape what slips past (see
// escapingWriter).
func escape(s string) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || !strconv.IsPrint(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case !strconv.IsPrint(r):
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// escapingWriter is the net under every printer: it writes through the
// bytes a terminal would act on (C0 controls other than newline and tab,
// and DEL) as Go escapes. Multi-byte controls (C1, format characters) are
// escape's job, which sees whole strings.
type escapingWriter struct{ w io.Writer }

func (e escapingWriter) Write(p []byte) (int, error) {
	start := 0
	for i, c := range p {
		if (c < 0x20 && c != '\n' && c != '\t') || c == 0x7f {
			if _, err := e.w.Write(p[start:i]); err != nil {
				return start, err
			}
			if _, err := fmt.Fprintf(e.w, `\x%02x`, c); err != nil {
				return i, err
			}
			start = i + 1
		}
	}
	if _, err := e.w.Write(p[start:]); err != nil {
		return start, err
	}
	return len(p), nil
}

// field is one "KEY: value" line of a details view.
type field struct{ key, value string }

// printFields writes aligned "KEY:  value" lines.
func printFields(w io.Writer, fields ...field) error {
	t := &table{tw: tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)}
	for _, f := range fields {
		t.row(f.key+":", f.value)
	}
	return t.flush()
}

// enumName renders a proto enum value without its type prefix, lower-cased:
// SERVER_STATE_UP is "up", ACCESS_MODE_READ_WRITE "read-write". The zero
// (UNSPECIFIED) value is "-"; an unknown number is printed as a number.
func enumName(e protoreflect.Enum) string {
	if e.Number() == 0 {
		return "-"
	}
	values := e.Descriptor().Values()
	v := values.ByNumber(e.Number())
	if v == nil {
		return strconv.Itoa(int(e.Number()))
	}
	name := string(v.Name())
	if zero := values.ByNumber(0); zero != nil {
		name = strings.TrimPrefix(name, strings.TrimSuffix(string(zero.Name()), "UNSPECIFIED"))
	}
	return strings.ToLower(strings.ReplaceAll(name, "_", "-"))
}

// orDash returns s, or "-" when it is empty.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// formatTime renders unix nanoseconds as RFC 3339 in UTC; 0 is "-".
func formatTime(unixNano int64) string {
	if unixNano == 0 {
		return "-"
	}
	return time.Unix(0, unixNano).UTC().Format(time.RFC3339)
}

// formatAge renders how long before now unixNano was, as "2s ago", "5m ago",
// "3h ago" or "4d ago"; 0 is "-". A time in the future (clock skew) is
// "0s ago".
func formatAge(now time.Time, unixNano int64) string {
	if unixNano == 0 {
		return "-"
	}
	d := max(now.Sub(time.Unix(0, unixNano)), 0)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d/time.Second))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d/time.Minute))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh ago", int(d/time.Hour))
	default:
		return fmt.Sprintf("%dd ago", int(d/(24*time.Hour)))
	}
}

// formatMap renders a string map as sorted "k=v" pairs, or "-" when empty.
func formatMap(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	pairs := make([]string, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		pairs = append(pairs, k+"="+m[k])
	}
	return strings.Join(pairs, ",")
}
