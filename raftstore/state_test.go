package raftstore

import (
	"encoding/base64"
	"errors"
	"slices"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
)

// --------------------------------------------------------------- paging

// walkPages lists everything with page size limit and returns the ids in
// the order received.
func walkPages[T any](t *testing.T, limit int, list func(token string, limit int) ([]T, string, error), id func(T) string, allowEmptyLast bool) []string {
	t.Helper()
	var ids []string
	token := ""
	for page := 0; ; page++ {
		if page > 100 {
			t.Fatalf("limit %d: more than 100 pages; the token does not advance", limit)
		}
		items, next, err := list(token, limit)
		if err != nil {
			t.Fatalf("limit %d, page %d: %v", limit, page, err)
		}
		if limit > 0 && len(items) > limit {
			t.Fatalf("limit %d, page %d: %d items", limit, page, len(items))
		}
		if len(items) == 0 && (next != "" || page > 0 && !allowEmptyLast) {
			t.Fatalf("limit %d, page %d: empty page, next token %q", limit, page, next)
		}
		for _, it := range items {
			ids = append(ids, id(it))
		}
		if next == "" {
			return ids
		}
		token = next
	}
}

func pagingFixture(t *testing.T) (f *FSM, volIDs []string, snapsOf map[string][]string, snapIDs []string) {
	f = openTestFSM(t, "")
	mustApply(t, f, cmdRegisterServer("s1", "", 0, nil))
	// Created out of id order: listing is by id, not by creation.
	for _, id := range []string{"v-07", "v-02", "v-10", "v-01", "v-05", "v-03", "v-09"} {
		mustApply(t, f, cmdCreateVolume(id, "name-of-"+id, mib, 1))
	}
	snapsOf = map[string][]string{}
	for _, s := range []struct{ id, vol string }{
		{"sn-04", "v-01"}, {"sn-01", "v-02"}, {"sn-03", "v-01"}, {"sn-02", "v-07"}, {"sn-05", "v-01"}, {"sn-06", "v-02"},
	} {
		mustApply(t, f, cmdCreateSnapshot(s.id, s.vol, "name-of-"+s.id))
		snapsOf[s.vol] = append(snapsOf[s.vol], s.id)
	}
	for _, ids := range snapsOf {
		slices.Sort(ids)
	}
	return f, []string{"v-01", "v-02", "v-03", "v-05", "v-07", "v-09", "v-10"},
		snapsOf, []string{"sn-01", "sn-02", "sn-03", "sn-04", "sn-05", "sn-06"}
}

func TestReaderPaging(t *testing.T) {
	f, volIDs, snapsOf, snapIDs := pagingFixture(t)
	view := func(fn func(r *Reader)) {
		t.Helper()
		if err := f.View(func(r *Reader) error { fn(r); return nil }); err != nil {
			t.Fatal(err)
		}
	}
	volID := func(v *storpb.Volume) string { return v.Id }
	snapID := func(s *storpb.Snapshot) string { return s.Id }

	t.Run("volumes", func(t *testing.T) {
		for limit := 0; limit <= len(volIDs)+1; limit++ {
			view(func(r *Reader) {
				got := walkPages(t, limit, r.Volumes, volID, false)
				if !slices.Equal(got, volIDs) {
					t.Errorf("limit %d: walked %v, want %v", limit, got, volIDs)
				}
			})
		}
	})
	t.Run("snapshots", func(t *testing.T) {
		for limit := 0; limit <= len(snapIDs)+1; limit++ {
			view(func(r *Reader) {
				list := func(token string, limit int) ([]*storpb.Snapshot, string, error) {
					return r.Snapshots("", token, limit)
				}
				if got := walkPages(t, limit, list, snapID, false); !slices.Equal(got, snapIDs) {
					t.Errorf("limit %d: walked %v, want %v", limit, got, snapIDs)
				}
			})
		}
	})
	t.Run("snapshots of one volume", func(t *testing.T) {
		for _, vol := range []string{"v-01", "v-02", "v-07", "v-05", "nope"} {
			want := snapsOf[vol]
			for limit := 0; limit <= len(snapIDs)+1; limit++ {
				view(func(r *Reader) {
					list := func(token string, limit int) ([]*storpb.Snapshot, string, error) {
						return r.Snapshots(vol, token, limit)
					}
					got := walkPages(t, limit, list, snapID, true)
					if !slices.Equal(got, want) {
						t.Errorf("volume %s, limit %d: walked %v, want %v", vol, limit, got, want)
					}
				})
			}
		}
	})
	t.Run("bad tokens", func(t *testing.T) {
		b64 := base64.RawURLEncoding.EncodeToString
		for _, token := range []string{
			"garbage!", "%%%", "====", b64([]byte("nope")), b64([]byte("v1:")), b64([]byte("v2:v-01")),
			base64.StdEncoding.EncodeToString([]byte("v1:v-01?")), // padded, other alphabet
		} {
			view(func(r *Reader) {
				if _, _, err := r.Volumes(token, 2); !errors.Is(err, ErrInvalidArgument) {
					t.Errorf("Volumes(%q): %v, want ErrInvalidArgument", token, err)
				}
				if _, _, err := r.Snapshots("", token, 2); !errors.Is(err, ErrInvalidArgument) {
					t.Errorf("Snapshots(%q): %v, want ErrInvalidArgument", token, err)
				}
				if _, _, err := r.Snapshots("v-01", token, 0); !errors.Is(err, ErrInvalidArgument) {
					t.Errorf("Snapshots(v-01, %q): %v, want ErrInvalidArgument", token, err)
				}
			})
		}
	})
	t.Run("item deleted between pages", func(t *testing.T) {
		var token string
		view(func(r *Reader) {
			page, next, err := r.Volumes("", 3)
			if err != nil || len(page) != 3 || next == "" {
				t.Fatalf("first page: %v, %q, %v", page, next, err)
			}
			token = next
		})
		// The token's own key goes away; the walk resumes after it.
		mustApply(t, f, cmdDeleteVolume(volIDs[2]))
		view(func(r *Reader) {
			got := walkPages(t, 2, func(tok string, limit int) ([]*storpb.Volume, string, error) {
				if tok == "" {
					tok = token
				}
				return r.Volumes(tok, limit)
			}, volID, false)
			if want := volIDs[3:]; !slices.Equal(got, want) {
				t.Errorf("resumed walk %v, want %v", got, want)
			}
		})
	})
}
