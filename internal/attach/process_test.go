package attach

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// fakeProcess records what PrepareProcess asks of the process and refuses
// what it is told to.
type fakeProcess struct {
	flusher     int   // SetIOFlusher calls
	adj         []int // SetOOMScoreAdj arguments
	flusherErr  error
	oomScoreErr error
}

func (f *fakeProcess) ops() Process {
	return Process{
		SetIOFlusher:   func() error { f.flusher++; return f.flusherErr },
		SetOOMScoreAdj: func(adj int) error { f.adj = append(f.adj, adj); return f.oomScoreErr },
	}
}

// PrepareProcess sets PR_SET_IO_FLUSHER and a low oom_score_adj, and
// reports (returns and logs) each refusal with its cause, still making
// the other setting.
func TestPrepareProcess(t *testing.T) {
	for _, tc := range []struct {
		name               string
		flusherErr, oomErr error
		want               []string // in the error and the log; none: nil
	}{
		{"both take", nil, nil, nil},
		{"no CAP_SYS_RESOURCE", unix.EPERM, unix.EACCES, []string{"PR_SET_IO_FLUSHER: operation not permitted (needs CAP_SYS_RESOURCE)", "oom_score_adj -900: permission denied"}},
		{"kernel before 5.6", unix.EINVAL, nil, []string{"PR_SET_IO_FLUSHER: invalid argument (a kernel before 5.6)"}},
		{"oom_score_adj refused", nil, unix.EACCES, []string{"oom_score_adj -900: permission denied"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeProcess{flusherErr: tc.flusherErr, oomScoreErr: tc.oomErr}
			var logs bytes.Buffer
			err := PrepareProcess(f.ops(), slog.New(slog.NewTextHandler(&logs, nil)))
			if f.flusher != 1 || len(f.adj) != 1 || f.adj[0] != OOMScoreAdj || OOMScoreAdj > -500 {
				t.Fatalf("PR_SET_IO_FLUSHER set %d times, oom_score_adj written %v; want once each, %d", f.flusher, f.adj, OOMScoreAdj)
			}
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("PrepareProcess: %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("PrepareProcess with refusals: nil error, want %q", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) || !strings.Contains(logs.String(), w) {
					t.Errorf("error %q / log %q: want %q in both", err, logs.String(), w)
				}
			}
			for _, e := range []error{tc.flusherErr, tc.oomErr} {
				if e != nil && !errors.Is(err, e) {
					t.Errorf("error %v does not wrap %v", err, e)
				}
			}
		})
	}
}
