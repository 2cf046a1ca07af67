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
	_, err = fmt.Fprintf(a.stdout, "%s\n", b)
	return err
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
	fmt.Fprintln(t.tw, strings.Join(cells, "\t"))
}

func (t *table) flush() error { return t.tw.Flush() }

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
